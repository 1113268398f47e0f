"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr``."""

from __future__ import annotations

import math

from megatron_charm.train.config import TrainConfig


def learning_rate(t: TrainConfig, iteration: int) -> float:
    """Learning rate for optimizer step ``iteration`` (0-based)."""
    if t.lr_warmup_iters > 0 and iteration < t.lr_warmup_iters:
        return t.lr * (iteration + 1) / t.lr_warmup_iters
    decay_iters = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    span = max(1, decay_iters - t.lr_warmup_iters)
    progress = min(1.0, max(0.0, (iteration - t.lr_warmup_iters) / span))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))
