"""Config-driven GPT pretraining on megatron-core with CHARM+ context parallelism.

``megatron-charm-train`` (:mod:`megatron_charm.train.cli`) is the command; :func:`train` the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_charm.train.config import Config, load_config

if TYPE_CHECKING:
    # typing only: the loop imports torch, which importing this package does not
    from megatron_charm.train.loop import GradHook, TrainResult


def train(cfg: Config, grad_hook: GradHook | None = None) -> TrainResult:
    """Run :func:`megatron_charm.train.loop.train` (imports megatron-core on first use)."""
    from megatron_charm.train.loop import train as _train

    return _train(cfg, grad_hook=grad_hook)


__all__ = ["Config", "load_config", "train"]
