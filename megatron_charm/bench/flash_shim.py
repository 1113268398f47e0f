"""A CPU stand-in for flash-attn's low-level functions, so ring-flash-attention runs on gloo.

ring-flash-attention imports ``_flash_attn_forward`` and ``_flash_attn_backward`` from
``flash_attn.flash_attn_interface``. On CPU there is no flash-attn; this module provides the two
functions (flash-attn 2.7/2.8 signatures, checked against the released sources in
tests/contract/test_flash_shim_contract.py; keyword-called by ring-flash-attention) over our own
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
    """``(out [b, s_q, h, d], lse float32 [b, h, s_q], None, None)`` like flash-attn 2.7+."""
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


def _sequence_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """One sequence of a varlen call: ``q [s_q, h, d]``, ``k, v [s_k, h_kv, d]`` ->
    ``(out [s_q, h, d], lse float32 [s_q, h])``. Causal masking is aligned at the bottom right,
    as flash-attn does when ``s_q < s_k``: the last query sees every key. That is a block of
    keys every query sees, then a causal square, computed apart and merged by their lse."""
    sq, sk = q.shape[0], k.shape[0]
    one = lambda t: t.unsqueeze(1)  # noqa: E731 - [s, 1, h, d] for the block kernel
    if not causal:
        out, lse = cpu_forward(one(q), one(k), one(v), False, scale)
        return out[:, 0], lse[:, 0]
    if sq > sk:
        raise ValueError("the CPU flash-attn shim's causal varlen needs s_q <= s_k per sequence")
    prefix = sk - sq
    out, lse = cpu_forward(one(q), one(k[prefix:]), one(v[prefix:]), True, scale)
    out, lse = out[:, 0], lse[:, 0]
    if prefix:
        o2, l2 = cpu_forward(one(q), one(k[:prefix]), one(v[:prefix]), False, scale)
        o2, l2 = o2[:, 0], l2[:, 0]
        total = torch.logaddexp(lse, l2)
        w1, w2 = (torch.exp(x - total).unsqueeze(-1) for x in (lse, l2))
        out = (out.float() * w1 + o2.float() * w2).to(q.dtype)
        lse = total
    return out, lse


def _flash_attn_varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    return_softmax: bool = False,
    block_table: Tensor | None = None,
    leftpad_k: Tensor | None = None,
    seqused_k: Tensor | None = None,
    zero_tensors: bool = False,
) -> tuple[Tensor, Tensor, None, None]:
    """Packed sequences: ``q [total_q, h, d]``, ``k, v [total_k, h_kv, d]``, sequence ``i`` at
    rows ``cu_seqlens[i]:cu_seqlens[i + 1]``; returns ``(out [total_q, h, d], lse float32
    [h, total_q], None, None)`` like flash-attn 2.7+."""
    _check_plain(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    _check_packed_only(block_table, leftpad_k, seqused_k, zero_tensors)
    t0 = time.perf_counter()
    outs, lses = [], []
    for (a, b), (c, d) in zip(_spans(cu_seqlens_q), _spans(cu_seqlens_k), strict=True):
        out, lse = _sequence_forward(q[a:b], k[c:d], v[c:d], causal, softmax_scale)
        outs.append(out)
        lses.append(lse)
    KERNEL_SECONDS[0] += time.perf_counter() - t0
    return torch.cat(outs), torch.cat(lses).transpose(0, 1).contiguous(), None, None


def _flash_attn_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor | None,
    dk: Tensor | None,
    dv: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    rng_state: Tensor | None = None,
    zero_tensors: bool = False,
) -> Tensor:
    """Write the gradients of a varlen call (shapes as :func:`_flash_attn_varlen_forward`,
    ``softmax_lse [h, total_q]``) into ``dq, dk, dv``; returns ``delta [h, total_q]``."""
    _check_plain(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    _check_packed_only(None, None, None, zero_tensors)
    t0 = time.perf_counter()
    one = lambda t: t.unsqueeze(1)  # noqa: E731
    lse_all = softmax_lse.transpose(0, 1)
    for (a, b), (c, d) in zip(_spans(cu_seqlens_q), _spans(cu_seqlens_k), strict=True):
        sq, sk = b - a, d - c
        prefix = sk - sq if causal else 0
        # the blocks of the forward, each with the merged out and lse (flash-attn's contract)
        blocks = [(prefix, sk, causal)] + ([(0, prefix, False)] if prefix else [])
        gq = torch.zeros(q[a:b].shape, dtype=torch.float32)
        gk, gv = (torch.zeros(k[c:d].shape, dtype=torch.float32) for _ in range(2))
        for lo, hi, masked in blocks:
            g = cpu_backward(
                one(dout[a:b]), one(q[a:b]), one(k[c + lo : c + hi]), one(v[c + lo : c + hi]),
                one(out[a:b]), one(lse_all[a:b]), masked, softmax_scale,
            )  # fmt: skip
            gq += g[0][:, 0].float()
            gk[lo:hi] += g[1][:, 0].float()
            gv[lo:hi] += g[2][:, 0].float()
        for dst, grad, rows in ((dq, gq, (a, b)), (dk, gk, (c, d)), (dv, gv, (c, d))):
            if dst is not None:
                dst[rows[0] : rows[1]].copy_(grad)
    KERNEL_SECONDS[1] += time.perf_counter() - t0
    return (dout.float() * out.float()).sum(-1).transpose(0, 1)


def _spans(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _check_packed_only(block_table, leftpad_k, seqused_k, zero_tensors) -> None:
    if block_table is not None or leftpad_k is not None or seqused_k is not None or zero_tensors:
        raise ValueError(
            "the CPU flash-attn shim's varlen functions take plain packed sequences only (no "
            "block_table, leftpad_k, seqused_k or zero_tensors); run the real flash-attn on CUDA"
        )


def _not_shimmed(*args, **kwargs):
    raise RuntimeError(
        "the CPU flash-attn shim provides the low-level _flash_attn_* functions only; "
        "flash_attn_func needs the real flash-attn on CUDA"
    )


def _check_plain(dropout_p, left, right, softcap, alibi) -> None:
    if dropout_p or left != -1 or right != -1 or softcap or alibi is not None:
        raise ValueError(
            "the CPU flash-attn shim supports plain attention only (dropout_p=0, no window, "
            "softcap or alibi); run the real flash-attn on CUDA for those"
        )


def _shim_modules() -> dict[str, types.ModuleType]:
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []  # a package, so that submodule imports resolve through sys.modules
    # the release whose signatures the shim follows (yunchang branches on it)
    pkg.__version__ = "2.8.3"
    pkg.flash_attn_func = _not_shimmed
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward = _flash_attn_forward
    iface._flash_attn_backward = _flash_attn_backward
    iface._flash_attn_varlen_forward = _flash_attn_varlen_forward
    iface._flash_attn_varlen_backward = _flash_attn_varlen_backward
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


def _check_varlen(gen: torch.Generator) -> float:
    """Largest difference of the varlen shim from float64 autograd: two packed sequences whose
    queries are the last rows of their keys (as ring-flash-attention's llama3 variant calls it),
    GQA, causal (aligned at the bottom right) and full."""
    h, h_kv, d, scale = 4, 2, 16, 0.25
    lens_q, lens_k = (5, 7), (9, 7)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()]) for x in (lens_q, lens_k))
    worst = 0.0
    for causal in (False, True):
        q, dout = (torch.randn(sum(lens_q), h, d, generator=gen) for _ in range(2))
        k, v = (torch.randn(sum(lens_k), h_kv, d, generator=gen) for _ in range(2))
        out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 9, 9, 0.0, scale, causal)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_varlen_backward(
            dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 9, 9, 0.0, scale, causal
        )
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        outs, lses = [], []
        for (a, b), (c, e) in zip(_spans(cu_q), _spans(cu_k), strict=True):
            qi = ref[0][a:b].transpose(0, 1)
            ki, vi = (t[c:e].repeat_interleave(h // h_kv, 1).transpose(0, 1) for t in ref[1:])
            scores = qi @ ki.transpose(1, 2) * scale
            if causal:
                rows, cols = torch.arange(b - a)[:, None], torch.arange(e - c)[None, :]
                scores = scores.masked_fill(cols > rows + (e - c) - (b - a), float("-inf"))
            lses.append(scores.logsumexp(-1))
            outs.append((scores.softmax(-1) @ vi).transpose(0, 1))
        ref_out = torch.cat(outs)
        ref_out.backward(dout.double())
        pairs = [(out, ref_out), (lse, torch.cat(lses, dim=1))]
        pairs += [(g, t.grad) for g, t in zip((dq, dk, dv), ref, strict=True)]
        for got, want in pairs:
            worst = max(worst, (got.double() - want.detach()).abs().max().item())
    return worst


@functools.cache
def load_llama3(use_shim: bool) -> tuple[Callable, Callable]:
    """``(llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func)`` from
    ring-flash-attention (its kv all-gather variant, one head group of kv at a time), loaded
    like :func:`load_zigzag_ring`."""
    load_zigzag_ring(use_shim)  # leaves the package (or its stub) in sys.modules
    ctx = installed() if use_shim else contextlib.nullcontext()
    with ctx:
        mod = importlib.import_module("ring_flash_attn.llama3_flash_attn_varlen")
    return mod.llama3_flash_attn_prepare_cu_seqlens, mod.llama3_flash_attn_varlen_func


@functools.cache
def load_usp(use_shim: bool) -> types.ModuleType:
    """yunchang (USP: Ulysses inside a group times a ring across groups), imported with the shim
    in place on CPU. Install it with ``pip install --no-deps yunchang==0.6.4``."""
    if importlib.util.find_spec("yunchang") is None:
        raise RuntimeError(
            "yunchang is not installed: pip install --no-deps yunchang==0.6.4 (make setup "
            "installs it), or leave usp out of --methods"
        )
    ctx = installed() if use_shim else contextlib.nullcontext()
    with ctx:
        return importlib.import_module("yunchang")


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
    worst = max(worst, _check_varlen(gen))
    KERNEL_SECONDS[0] = KERNEL_SECONDS[1] = 0.0
    if worst > 1e-4:
        raise AssertionError(f"flash-attn CPU shim differs from the reference by {worst:.2e}")
    return worst
