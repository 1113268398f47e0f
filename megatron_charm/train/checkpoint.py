"""Checkpoints: model + optimizer (rank 0), run metadata as JSON, and each rank's RNG state.

With tensor and pipeline parallel size 1 every rank holds the same weights and optimizer state
(gradients are all-reduced before each step), so one copy is written and every rank loads it.

Layout of ``<dir>/iter_NNNNNNN/``: ``model_optim.pt`` (tensors and plain data only),
``meta.json`` (iteration, learning-rate schedule, resolved config) and ``rng_RRRRR.pt`` per rank.
``<dir>/latest`` names the newest complete checkpoint.

Safety: files are read with ``torch.load(weights_only=True)``, so a checkpoint from elsewhere
cannot run code when it is loaded. Every file is written to a temporary name and renamed into
place, and ``latest`` is replaced only after every rank has finished, so a crash during a save
leaves ``latest`` at the previous complete checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist

LATEST = "latest"
MODEL_FILE = "model_optim.pt"
META_FILE = "meta.json"


def iteration_dir(root: Path, iteration: int) -> Path:
    """The folder of checkpoint ``iteration`` under ``root``."""
    return root / f"iter_{iteration:07d}"


def rng_file(directory: Path, global_rank: int) -> Path:
    """The RNG-state file of ``global_rank`` in a checkpoint folder."""
    return directory / f"rng_{global_rank:05d}.pt"


# --- RNG state as tensors and plain data (loadable with weights_only=True) ------------------


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy, Python (and CUDA) generator states, without numpy arrays."""
    kind, keys, pos, has_gauss, cached = numpy.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(numpy.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    numpy.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(numpy.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py_state = state["python"]
    random.setstate((py_state["version"], tuple(py_state["state"]), py_state["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- writing ---------------------------------------------------------------------------------


def _atomic_write(path: Path, write: Any) -> None:
    """Call ``write(file)`` on a temporary file, flush it to disk, then rename it to ``path``."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_state(directory: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write the model/optimizer state and the JSON metadata of one checkpoint (rank 0)."""
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(directory / MODEL_FILE, lambda f: torch.save(state, f))
    text = json.dumps(meta, indent=1, sort_keys=True).encode()
    _atomic_write(directory / META_FILE, lambda f: f.write(text))


def write_rng(directory: Path, global_rank: int) -> None:
    """Write this rank's RNG state into a checkpoint folder."""
    _atomic_write(rng_file(directory, global_rank), lambda f: torch.save(rng_state(), f))


def commit_latest(root: Path, iteration: int) -> None:
    """Point ``latest`` at ``iteration``; called once every file of the checkpoint exists."""
    _atomic_write(root / LATEST, lambda f: f.write(str(iteration).encode()))


def save_checkpoint(
    root: Path, iteration: int, state: dict[str, Any], meta: dict[str, Any]
) -> Path:
    """Write checkpoint ``iteration`` (collective: every rank calls it)."""
    global_rank = dist.get_rank()
    directory = iteration_dir(root, iteration)
    if global_rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if global_rank == 0:
        write_state(directory, state, {**meta, "iteration": iteration})
    write_rng(directory, global_rank)
    dist.barrier()
    if global_rank == 0:
        commit_latest(root, iteration)
    dist.barrier()
    return directory


# --- reading ---------------------------------------------------------------------------------


def complete_iterations(root: Path) -> list[int]:
    """Iterations under ``root`` whose model, optimizer and metadata files all exist."""
    found = []
    for path in root.glob("iter_*"):
        suffix = path.name.removeprefix("iter_")
        if suffix.isdigit() and (path / MODEL_FILE).is_file() and (path / META_FILE).is_file():
            found.append(int(suffix))
    return sorted(found)


def _way_out(root: Path, damaged: int | None = None) -> str:
    # The damaged iteration still has all its files; offering it back would send the user round.
    others = [i for i in complete_iterations(root) if i != damaged]
    earlier = (
        f"write one of the complete iterations ({', '.join(map(str, others))}) into "
        f"{root / LATEST}, or "
        if others
        else ""
    )
    return (
        f"To continue, {earlier}start over with checkpoint.resume=false and run.overwrite=true "
        "(--overwrite)."
    )


def latest_iteration(root: Path) -> int | None:
    """Iteration of the latest complete checkpoint under ``root``, or ``None``.

    Raises:
        ValueError: ``latest`` exists but does not hold an iteration number.
    """
    marker = root / LATEST
    if not marker.is_file():
        return None
    text = marker.read_text(errors="replace").strip()
    if not text.isdigit():
        raise ValueError(
            f"checkpoint marker {marker} holds {text[:40]!r}, not an iteration number. "
            + _way_out(root)
        )
    return int(text)


def _unpickler_reason(exc: Exception) -> str:
    """The one line of torch's refusal that says what was refused (not how to bypass it)."""
    for line in str(exc).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(". Please")[0].strip()
    return type(exc).__name__


def _load(path: Path, what: str, root: Path, iteration: int) -> Any:
    if not path.is_file():
        raise ValueError(f"{what} {path} is missing. " + _way_out(root, iteration))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = _unpickler_reason(exc)
        raise ValueError(
            f"{what} {path} cannot be loaded safely: it is truncated, or holds objects other "
            f"than tensors and plain data, which are never unpickled ({reason}). "
            + _way_out(root, iteration)
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise ValueError(
            f"{what} {path} is truncated or corrupt ({type(exc).__name__}: "
            f"{str(exc).strip()[:200]}). " + _way_out(root, iteration)
        ) from None


def read_checkpoint(root: Path, iteration: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The saved model/optimizer state and metadata of checkpoint ``iteration`` (no RNG).

    Raises:
        ValueError: a file is missing, truncated or not a plain-data checkpoint; the message
            names the file and how to continue.
    """
    directory = iteration_dir(root, iteration)
    if not directory.is_dir():
        raise ValueError(
            f"{root / LATEST} points at iteration {iteration}, but {directory} does not exist. "
            + _way_out(root)
        )
    state = _load(directory / MODEL_FILE, "checkpoint file", root, iteration)
    meta_path = directory / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"checkpoint metadata {meta_path} is missing. " + _way_out(root, iteration)
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"checkpoint metadata {meta_path} is corrupt ({exc}). " + _way_out(root, iteration)
        ) from None
    if not isinstance(state, dict) or not isinstance(meta, dict):
        raise ValueError(
            f"{directory} is not a megatron-charm checkpoint. " + _way_out(root, iteration)
        )
    return state, meta


def restore_rng(root: Path, iteration: int, global_rank: int) -> bool:
    """Restore ``global_rank``'s RNG state from checkpoint ``iteration``; False if none saved.

    A job resumed with more ranks than it saved with finds no file for the new ranks; they keep
    their freshly seeded generators.
    """
    path = rng_file(iteration_dir(root, iteration), global_rank)
    if not path.is_file():
        return False
    state = _load(path, "RNG state file", root, iteration)
    try:
        set_rng_state(state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise ValueError(
            f"RNG state file {path} does not hold a generator state ({exc}). "
            + _way_out(root, iteration)
        ) from None
    return True


def load_checkpoint(root: Path, iteration: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read checkpoint ``iteration`` and restore this rank's RNG state (every rank calls it)."""
    state, meta = read_checkpoint(root, iteration)
    restore_rng(root, iteration, dist.get_rank())
    return state, meta
