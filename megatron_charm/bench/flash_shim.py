"""A CPU stand-in for flash-attn's low-level functions, so ring-flash-attention runs on gloo.

ring-flash-attention imports ``_flash_attn_forward`` and ``_flash_attn_backward`` from
``flash_attn.flash_attn_interface``. On CPU there is no flash-attn; this module provides the two
functions (flash-attn >= 2.6 signatures, keyword-called by ring-flash-attention) over our own
CPU block kernel (PyTorch's CPU flash-attention ops; the same kernel as our methods, so the
comparison is of schedules), and installs them as ``flash_attn.flash_attn_interface`` in
``sys.modules`` only inside :func:`installed`. It is benchmark code: the library never imports it.

Shapes follow flash-attn: ``q [b, s_q, h, d]``, ``k, v [b, s_k, h_kv, d]``, ``lse`` float32
``[b, h, s_q]``. The time spent inside the two functions is added to :data:`KERNEL_SECONDS`, so
the benchmark can tell computing from waiting for ring-flash-attention too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import time
import types
from collections.abc import Callable, Iterator

import torch

from megatron_charm.kernels.torch_kernel import cpu_backward, cpu_forward

Tensor = torch.Tensor

#: Seconds spent in the shim's kernels since the last reset (forward, backward).
KERNEL_SECONDS = [0.0, 0.0]


def _flash_attn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    return_softmax: bool = False,
) -> tuple[Tensor, Tensor, None, None]:
    """``(out [b, s_q, h, d], lse float32 [b, h, s_q], None, None)`` like flash-attn 2.6+."""
    _check_plain(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    t0 = time.perf_counter()
    # our own CPU block kernel, so that both sides of a comparison compute alike
    sbhd = lambda x: x.transpose(0, 1)  # noqa: E731
    out, lse = cpu_forward(sbhd(q), sbhd(k), sbhd(v), causal, softmax_scale)
    out, lse = sbhd(out), lse.permute(1, 2, 0)
    KERNEL_SECONDS[0] += time.perf_counter() - t0
    return out, lse, None, None


def _flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor | None,
    dk: Tensor | None,
    dv: Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    rng_state: Tensor | None = None,
) -> Tensor:
    """Write the gradients into ``dq, dk, dv`` (flash-attn's contract); returns the softmax
    row sums ``delta`` ``[b, h, s_q]`` in their place (ring-flash-attention ignores it)."""
    _check_plain(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    t0 = time.perf_counter()
    sbhd = lambda x: x.transpose(0, 1)  # noqa: E731
    lse = softmax_lse.permute(2, 0, 1)
    grads = cpu_backward(*(sbhd(x) for x in (dout, q, k, v, out)), lse, causal, softmax_scale)
    grads = tuple(sbhd(g) for g in grads)
    for dst, g in zip((dq, dk, dv), grads, strict=True):
        if dst is not None:
            dst.copy_(g)
    KERNEL_SECONDS[1] += time.perf_counter() - t0
    return (dout.float() * out.float()).sum(-1).transpose(1, 2)


def _check_plain(dropout_p, left, right, softcap, alibi) -> None:
    if dropout_p or left != -1 or right != -1 or softcap or alibi is not None:
        raise ValueError(
            "the CPU flash-attn shim supports plain attention only (dropout_p=0, no window, "
            "softcap or alibi); run the real flash-attn on CUDA for those"
        )


def _shim_modules() -> dict[str, types.ModuleType]:
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []  # a package, so that submodule imports resolve through sys.modules
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward = _flash_attn_forward
    iface._flash_attn_backward = _flash_attn_backward
    pkg.flash_attn_interface = iface
    return {"flash_attn": pkg, "flash_attn.flash_attn_interface": iface}


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Make ``import flash_attn.flash_attn_interface`` return the shim inside the block.

    Refuses when the real flash-attn is importable: then it must be used, not shadowed.
    """
    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        raise RuntimeError(
            "flash-attn is installed; the CPU shim would shadow it. Run ring-flash-attention on "
            "CUDA with the real flash-attn, or uninstall flash-attn for a CPU benchmark"
        )
    saved = {
        name: sys.modules.get(name) for name in ("flash_attn", "flash_attn.flash_attn_interface")
    }
    sys.modules.update(_shim_modules())
    try:
        yield
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


@functools.cache
def load_zigzag_ring(use_shim: bool) -> tuple[Callable, Callable]:
    """``(zigzag_ring_flash_attn_func, ring_flash_attn_func)`` from ring-flash-attention.

    The package's ``__init__`` also imports its Hugging Face adapter (transformers) and triton
    helpers, which a CPU benchmark does not have; only the two algorithm modules and their
    ``utils`` are loaded then, from the installed package, without running its ``__init__``.
    """
    spec = importlib.util.find_spec("ring_flash_attn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "ring-flash-attention is not installed: pip install ring-flash-attn==0.1.8 "
            "(add --no-deps on CPU machines: it would pull a CUDA torch)"
        )
    ctx = installed() if use_shim else contextlib.nullcontext()
    with ctx:
        try:
            import ring_flash_attn as pkg  # the whole package, when its dependencies exist

            return pkg.zigzag_ring_flash_attn_func, pkg.ring_flash_attn_func
        except ImportError:
            for name in [n for n in sys.modules if n.startswith("ring_flash_attn")]:
                del sys.modules[name]
        stub = types.ModuleType("ring_flash_attn")
        stub.__path__ = list(spec.submodule_search_locations)
        stub.__file__ = os.path.join(stub.__path__[0], "__init__.py")
        sys.modules["ring_flash_attn"] = stub
        zz = importlib.import_module("ring_flash_attn.zigzag_ring_flash_attn")
        ring = importlib.import_module("ring_flash_attn.ring_flash_attn")
    return zz.zigzag_ring_flash_attn_func, ring.ring_flash_attn_func


def check_shim(seed: int = 0) -> float:
    """Compare the shim's forward and backward with the float64 reference; return the largest
    difference (raises ``AssertionError`` above the float32 tolerance). Runs in float32 with GQA
    and both mask settings, at a size that takes milliseconds."""
    from megatron_charm.kernels.backends import _KERNELS

    gen = torch.Generator().manual_seed(seed)
    b, s, h, h_kv, d = 2, 48, 4, 2, 32
    worst = 0.0
    for causal in (False, True):
        q, dout = (torch.randn(b, s, h, d, generator=gen) for _ in range(2))
        k, v = (torch.randn(b, s, h_kv, d, generator=gen) for _ in range(2))
        scale = d**-0.5
        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, causal)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal)
        sb = lambda t: t.transpose(0, 1).double()  # noqa: E731 - math kernel takes [s, b, h, d]
        ref_out, ref_lse = _KERNELS["math"].forward(sb(q), sb(k), sb(v), causal, scale)
        grads = _KERNELS["math"].backward(
            sb(dout), sb(q), sb(k), sb(v), ref_out, ref_lse, causal, scale
        )
        pairs = [
            (out, ref_out.transpose(0, 1)),
            (lse, ref_lse.permute(1, 2, 0)),
            *((g, r.transpose(0, 1)) for g, r in zip((dq, dk, dv), grads, strict=True)),
        ]
        for got, ref in pairs:
            worst = max(worst, (got.double() - ref.double()).abs().max().item())
    KERNEL_SECONDS[0] = KERNEL_SECONDS[1] = 0.0
    if worst > 1e-4:
        raise AssertionError(f"flash-attn CPU shim differs from the reference by {worst:.2e}")
    return worst
