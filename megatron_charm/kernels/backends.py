"""Block attention backends and their selection.

Every backend computes one block: queries ``q [s_q, b, h, d]`` against keys and values
``k, v [s_k, b, h_kv, d]`` (``h % h_kv == 0``: kv travels at ``h_kv`` heads), optionally causal on
local positions (``s_q == s_k``). Forward returns ``out [s_q, b, h, d]`` in the input dtype and
``lse`` float32 ``[s_q, b, h]``. Backward takes the *final* ``out`` and ``lse`` of the queries (not
the block's own), so that block gradients sum to the exact gradient, and returns ``dq`` like q and
``dk, dv`` like k, v.

Backends:

* ``torch`` (:mod:`.torch_kernel`): PyTorch's ops: the CPU flash kernel on CPU; FlashAttention-2
  for fp16/bf16 and the memory-efficient kernel for fp32 on CUDA;
* ``flash_attn`` (:mod:`.flash_attn_kernel`): the flash-attn package, CUDA fp16/bf16 only;
* ``math`` (:mod:`.math_kernel`): explicit softmax in float64, the reference for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_charm.constants import KERNEL_NAMES
from megatron_charm.kernels.flash_attn_kernel import load_flash_attn
from megatron_charm.kernels.heads import expand_kv_heads, fold_kv_heads
from megatron_charm.kernels.math_kernel import math_backward, math_forward
from megatron_charm.kernels.torch_kernel import cpu_native_gqa, torch_backward, torch_forward

Tensor = torch.Tensor


@dataclass(frozen=True)
class BlockKernel:
    """A block attention backend (see the module docstring for shapes).

    ``native_gqa(device, dtype)`` says whether the kernel computes GQA without expanding kv heads
    itself; when it does not, a caller that reuses one kv block for many query blocks may expand
    it once (``h_kv == h`` is always accepted) and fold the kv gradients once.
    """

    name: str
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    native_gqa: Callable[[torch.device, torch.dtype], bool] = lambda device, dtype: False


def _torch_native_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "cuda":
        return dtype in (torch.float16, torch.bfloat16)
    return cpu_native_gqa()


_KERNELS = {
    "torch": BlockKernel("torch", torch_forward, torch_backward, _torch_native_gqa),
    "math": BlockKernel("math", math_forward, math_backward),
}
NAMES = KERNEL_NAMES
_HALF = (torch.float16, torch.bfloat16)


def _flash_attn_kernel() -> BlockKernel | None:
    iface, _ = load_flash_attn()
    if iface is None:
        return None
    return BlockKernel("flash_attn", iface.forward, iface.backward, lambda dev, dt: True)


def available_kernels(device: torch.device) -> list[str]:
    """Kernel names usable on ``device``, preferred first. On CUDA this imports flash-attn once."""
    names = ["torch", "math"]
    if device.type == "cuda" and _flash_attn_kernel() is not None:
        names.insert(0, "flash_attn")
    return names


def check_kernel_name(kernel: object, setting: str, unset: str) -> None:
    """Refuse a block kernel given by name that is none of :data:`NAMES` (a
    :class:`BlockKernel` or ``None`` passes): ``setting`` names where the value came from (an
    argument, a config key, a variable), ``unset`` what leaving it unset does.

    Raises:
        ValueError: ``"{setting}={kernel!r} is not a block kernel; use one of ..., or {unset}"``.
    """
    if isinstance(kernel, str) and kernel not in NAMES:
        raise ValueError(
            f"{setting}={kernel!r} is not a block kernel; use one of {', '.join(NAMES)}, or {unset}"
        )


def select_kernel(device: torch.device, dtype: torch.dtype, name: str | None = None) -> BlockKernel:
    """Pick the block kernel for ``(device, dtype)``; ``name`` overrides the choice.

    Default (``name=None``): ``math`` for float64; on CUDA ``flash_attn`` for fp16/bf16 when it
    imports, else ``torch`` (which runs fp32 on the memory-efficient kernel, never the float64
    reference). The choice depends on the arguments only: no environment variable is read here
    (``MEGATRON_CHARM_KERNEL`` is the trainer's and the Megatron module's default, read there,
    :mod:`megatron_charm.env`).

    Raises:
        ValueError: unknown name, or a kernel that cannot run this device/dtype.
    """
    if name is not None and name not in NAMES:
        raise ValueError(
            f"unknown block kernel {name!r}; expected one of {sorted(NAMES)} or None (the "
            "default by device and dtype)"
        )
    if name is None:
        if dtype == torch.float64:
            return _KERNELS["math"]
        if device.type == "cuda" and dtype in _HALF:
            return _flash_attn_kernel() or _KERNELS["torch"]
        return _KERNELS["torch"]
    if name == "flash_attn":
        if device.type != "cuda":
            raise ValueError(
                f"block kernel 'flash_attn' is not available on device {device}; it needs CUDA "
                "(use kernel='torch', or kernel=None for the default by device and dtype)"
            )
        if dtype not in _HALF:
            raise ValueError(
                f"block kernel 'flash_attn' needs float16 or bfloat16 inputs, got {dtype}; cast "
                "q, k, v or use kernel='torch'"
            )
        kern = _flash_attn_kernel()
        if kern is None:
            raise ValueError(
                f"block kernel 'flash_attn' was requested but {load_flash_attn()[1]}; "
                "use kernel='torch', or kernel=None for the default by device and dtype"
            )
        return kern
    if name == "torch" and device.type == "cuda" and dtype not in (*_HALF, torch.float32):
        raise ValueError(
            f"block kernel 'torch' on CUDA takes float16, bfloat16 or float32, got {dtype}; cast "
            "q, k, v or use kernel='math'"
        )
    return _KERNELS[name]


__all__ = [
    "BlockKernel",
    "NAMES",
    "available_kernels",
    "check_kernel_name",
    "expand_kv_heads",
    "fold_kv_heads",
    "select_kernel",
]
