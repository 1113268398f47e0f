"""Config-driven GPT pretraining on megatron-core with CHARM+ context parallelism.

``megatron-charm-train`` (:mod:`megatron_charm.train.cli`) is the command; :func:`train` the loop.
"""

from megatron_charm.train.config import Config, load_config


def train(cfg: Config, grad_hook=None):  # noqa: ANN001, ANN201 - re-export with lazy import
    """Run :func:`megatron_charm.train.loop.train` (imports megatron-core on first use)."""
    from megatron_charm.train.loop import train as _train

    return _train(cfg, grad_hook=grad_hook)


__all__ = ["Config", "load_config", "train"]
