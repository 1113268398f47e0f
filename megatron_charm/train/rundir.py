"""What a run may do with its run directory: continue it, start it, or replace it.

A fresh run into a directory that already holds another run's metrics or checkpoints would
silently mix or destroy them, so it is refused unless the user says which one they want:
``--resume`` (``checkpoint.resume=true``) continues, ``--overwrite`` (``run.overwrite=true``)
starts over.
"""

from __future__ import annotations

from megatron_charm.train import checkpoint as ckpt
from megatron_charm.train.config import Config

METRICS_FILE = "metrics.jsonl"


def resume_iteration(cfg: Config) -> int | None:
    """The checkpoint iteration this run continues from, or ``None`` for a fresh run.

    Raises:
        ValueError: ``latest`` is unreadable (the message says how to continue).
    """
    if not cfg.checkpoint.resume:
        return None
    return ckpt.latest_iteration(cfg.checkpoint_dir)


def previous_outputs(cfg: Config) -> list[str]:
    """Files of an earlier run that a fresh run would replace."""
    found = []
    metrics = cfg.run_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(str(metrics))
    root = cfg.checkpoint_dir
    if (root / ckpt.LATEST).exists() or any(root.glob("iter_*")):
        found.append(f"checkpoints in {root}")
    return found


def check_run_dir(cfg: Config) -> int | None:
    """Decide between resuming and starting fresh; refuse to clobber an earlier run.

    Returns the iteration to resume from, or ``None`` for a fresh run.

    Raises:
        ValueError: a fresh run would replace an earlier run's outputs and ``run.overwrite``
            is false, or the latest checkpoint marker is unreadable.
    """
    start = resume_iteration(cfg)
    if start is not None or cfg.run.overwrite:
        return start
    found = previous_outputs(cfg)
    if found:
        raise ValueError(
            f"run directory {cfg.run_dir} already holds an earlier run ({', '.join(found)}). "
            "Pass --resume (checkpoint.resume=true) to continue it, --overwrite "
            "(run.overwrite=true) to train from scratch and replace it, or choose another "
            "--run-dir."
        )
    return None


def clear_previous(cfg: Config) -> None:
    """Before a fresh run with ``run.overwrite``: forget the earlier run's latest checkpoint.

    Its iteration folders stay until this run saves over them, but nothing resumes from them.
    """
    (cfg.checkpoint_dir / ckpt.LATEST).unlink(missing_ok=True)
