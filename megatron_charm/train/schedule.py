"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megatron_charm.train.config import TrainConfig


def learning_rate(t: TrainConfig, iteration: int) -> float:
    """Learning rate for optimizer step ``iteration`` (0-based)."""
    if t.lr_warmup_iters > 0 and iteration < t.lr_warmup_iters:
        return t.lr * (iteration + 1) / t.lr_warmup_iters
    decay_iters = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    span = max(1, decay_iters - t.lr_warmup_iters)
    progress = min(1.0, max(0.0, (iteration - t.lr_warmup_iters) / span))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def resolved_schedule(t: TrainConfig) -> dict[str, int]:
    """The schedule lengths in force with the defaults filled in (saved with each checkpoint)."""
    return {
        "lr_warmup_iters": t.lr_warmup_iters,
        "lr_decay_iters": t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters,
    }


def schedule_on_resume(t: TrainConfig, saved: dict[str, Any]) -> TrainConfig:
    """The schedule a resumed run follows, given the one its checkpoint saved.

    ``lr_decay_iters`` defaults to ``train_iters``, so raising ``train.train_iters`` to train
    longer would stretch the cosine and make the learning rate jump up at the resume step.
    Unless the config sets ``train.lr_decay_iters`` itself, the saved decay length is kept
    (with ``lr_decay_iters`` filled in, so the caller can tell and say so).
    """
    saved_decay = saved.get("lr_decay_iters")
    if t.lr_decay_iters is not None or saved_decay is None or saved_decay == t.train_iters:
        return t
    return dataclasses.replace(t, lr_decay_iters=int(saved_decay))
