"""Constants that more than one layer needs. Each has one home, here or where it is documented."""

from __future__ import annotations

from datetime import timedelta

DEFAULT_TIMEOUT_S: float = 600.0
"""Seconds before a blocked collective or exchange fails: Megatron-LM's own default
(``--distributed-timeout-minutes 10``), so that our channel groups and Megatron's agree."""

DEFAULT_TIMEOUT = timedelta(seconds=DEFAULT_TIMEOUT_S)

KERNEL_NAMES: tuple[str, ...] = ("flash_attn", "torch", "math")
"""The block kernels by name (:mod:`megatron_charm.kernels.backends`); here so that argument
parsers can offer them without importing torch."""
