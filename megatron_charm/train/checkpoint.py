"""Checkpoints: model + optimizer + iteration (rank 0), and each rank's RNG state.

With tensor and pipeline parallel size 1 every rank holds the same weights and optimizer state
(gradients are all-reduced before each step), so one copy is written and every rank loads it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist

LATEST = "latest"


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": numpy.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(
    root: Path, iteration: int, state: dict[str, Any], extra: dict[str, Any]
) -> Path:
    """Write checkpoint ``iteration`` (collective: every rank calls it)."""
    global_rank = dist.get_rank()
    directory = _iter_dir(root, iteration)
    if global_rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if global_rank == 0:
        _atomic_save({"iteration": iteration, **state, **extra}, directory / "model_optim.pt")
    _atomic_save(_rng_state(), directory / f"rng_{global_rank:05d}.pt")
    dist.barrier()
    if global_rank == 0:
        # Written last, so a crash mid-save leaves the previous checkpoint as the latest.
        tmp = root / (LATEST + ".tmp")
        tmp.write_text(str(iteration))
        os.replace(tmp, root / LATEST)
    dist.barrier()
    return directory


def latest_iteration(root: Path) -> int | None:
    """Iteration of the latest complete checkpoint under ``root``, or ``None``."""
    marker = root / LATEST
    if not marker.is_file():
        return None
    return int(marker.read_text().strip())


def load_checkpoint(root: Path, iteration: int) -> dict[str, Any]:
    """Read checkpoint ``iteration`` and restore this rank's RNG state. Returns the saved dict."""
    directory = _iter_dir(root, iteration)
    state = torch.load(directory / "model_optim.pt", map_location="cpu", weights_only=False)
    rng_path = directory / f"rng_{dist.get_rank():05d}.pt"
    if rng_path.is_file():
        _set_rng_state(torch.load(rng_path, weights_only=False))
    return state
