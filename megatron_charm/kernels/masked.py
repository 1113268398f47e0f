"""One block under a document mask: the dense kernel per span, merged (forward and backward).

A masked block is a list of :class:`megatron_charm.plan.docmask.Span` rectangles (Note [Block
spans]). ``full`` and ``causal`` spans run the block kernel as it is, unmasked or causal; ``band``
spans (sliding windows) run :func:`band_forward` / :func:`band_backward`: on CPU PyTorch's flash
op with the band as an additive mask, elsewhere an explicit softmax in float32 (float64 for
float64 inputs). Rows that no span covers keep
``lse = -inf`` and a zero output, which the merge of partials treats as "no keys"
(:func:`megatron_charm.kernels.merge.merge_partial`); their gradients are zero.

Shapes are the block kernel's: ``q [s_q, b, h, d]``, ``k, v [s_k, b, h_kv, d]``, ``out`` like q,
``lse`` float32 ``[s_q, b, h]``. On CUDA in fp16/bf16 a block with several spans runs
FlashAttention-2's varlen mode instead, a few launches per block (Note [Varlen spans] in
:mod:`megatron_charm.kernels.varlen`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_charm.kernels.backends import BlockKernel
from megatron_charm.kernels.heads import expand_kv_heads, fold_kv_heads
from megatron_charm.kernels.merge import merge_partial
from megatron_charm.kernels.torch_kernel import cpu_backward, cpu_compute_dtype, cpu_forward
from megatron_charm.kernels.varlen import varlen_backward, varlen_forward
from megatron_charm.plan.docmask import Span

Tensor = torch.Tensor


def _varlen(q: Tensor) -> bool:
    """Whether the block runs FlashAttention-2's varlen mode (CUDA fp16/bf16, Note [Varlen
    spans]); :data:`VARLEN_DEVICES` lets the contract tests run it on CPU fakes."""
    return q.device.type in VARLEN_DEVICES and q.dtype in (torch.float16, torch.bfloat16)


#: Device types whose half-precision masked blocks run :mod:`megatron_charm.kernels.varlen`.
VARLEN_DEVICES: frozenset[str] = frozenset({"cuda"})


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _band_keep(span: Span, device: torch.device) -> Tensor:
    """``[s_q, s_k]`` bool: pair (i, j) of the span is allowed."""
    i = torch.arange(span.q1 - span.q0, device=device).unsqueeze(1)
    j = torch.arange(span.k1 - span.k0, device=device).unsqueeze(0)
    delta = span.shift + j - i
    return (delta >= span.lo) & (delta <= span.hi)


def _band_scores(q: Tensor, k: Tensor, keep: Tensor, scale: float) -> Tensor:
    dt = _work_dtype(q.dtype)
    s = torch.einsum("qbhd,kbhd->bhqk", q.to(dt), k.to(dt)) * scale
    return s.masked_fill(~keep, float("-inf"))


def _cpu_bias(span: Span, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The additive mask of a span for the CPU flash op, and which rows have no key."""
    keep = _band_keep(span, torch.device("cpu"))
    bias = torch.zeros(keep.shape, dtype=cpu_compute_dtype(dtype)).masked_fill_(~keep, -torch.inf)
    return bias, ~keep.any(dim=1)


def band_forward(
    q: Tensor, k: Tensor, v: Tensor, span: Span, scale: float
) -> tuple[Tensor, Tensor]:
    """A ``band`` span: ``out`` in q's dtype (zero on rows without keys), ``lse`` float32
    (``-inf`` there). On CPU PyTorch's flash op with an additive mask; elsewhere (and for
    float64) an explicit softmax."""
    if q.device.type == "cpu" and q.dtype != torch.float64:
        bias, empty = _cpu_bias(span, q.dtype)
        out, lse = cpu_forward(q, k, v, False, scale, bias)
        lse = lse.float().masked_fill(empty[:, None, None], -torch.inf)
        return out.masked_fill(empty[:, None, None, None], 0.0), lse
    k, v = expand_kv_heads(k, q.shape[2]), expand_kv_heads(v, q.shape[2])
    s = _band_scores(q, k, _band_keep(span, q.device), scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)  # rows without keys: -inf - -inf
    out = torch.einsum("bhqk,kbhd->qbhd", p, v.to(p.dtype))
    return out.to(q.dtype), lse.permute(2, 0, 1).float()


def band_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    span: Span,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of a ``band`` span given the queries' final ``out`` and ``lse`` (the CPU flash
    op, or an explicit softmax, as :func:`band_forward`)."""
    if q.device.type == "cpu" and q.dtype != torch.float64:
        bias, _ = _cpu_bias(span, q.dtype)
        return cpu_backward(dout, q, k, v, out, lse, False, scale, bias)
    h, hkv = q.shape[2], k.shape[2]
    dt = _work_dtype(q.dtype)
    ke, ve = expand_kv_heads(k, h).to(dt), expand_kv_heads(v, h).to(dt)
    s = _band_scores(q, ke, _band_keep(span, q.device), scale)
    p = torch.exp(s - lse.permute(1, 2, 0).to(dt).unsqueeze(-1))
    do = dout.to(dt)
    dv = torch.einsum("bhqk,qbhd->kbhd", p, do)
    dp = torch.einsum("qbhd,kbhd->bhqk", do, ve)
    delta = (do * out.to(dt)).sum(-1).permute(1, 2, 0).unsqueeze(-1)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhqk,kbhd->qbhd", ds, ke)
    dk = torch.einsum("bhqk,qbhd->kbhd", ds, q.to(dt))
    return dq, fold_kv_heads(dk, hkv), fold_kv_heads(dv, hkv)


def masked_forward(
    kernel: BlockKernel, q: Tensor, k: Tensor, v: Tensor, spans: Sequence[Span], scale: float
) -> tuple[Tensor, Tensor]:
    """Forward of one masked block: ``out`` in q's dtype, ``lse`` float32 (``-inf`` on rows
    without keys)."""
    if len(spans) == 1 and spans[0].mode != "band":
        sp = spans[0]
        if (sp.q0, sp.q1, sp.k0, sp.k1) == (0, q.shape[0], 0, k.shape[0]):
            return kernel.forward(q, k, v, sp.mode == "causal", scale)
    if _varlen(q):
        return varlen_forward(q, k, v, spans, scale)
    dt = _work_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=dt, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=dt, device=q.device)
    for sp in spans:
        qs, ks = slice(sp.q0, sp.q1), slice(sp.k0, sp.k1)
        if sp.mode == "band":
            o, m = band_forward(q[qs], k[ks], v[ks], sp, scale)
        else:
            o, m = kernel.forward(q[qs], k[ks], v[ks], sp.mode == "causal", scale)
        merge_partial(out[qs], lse[qs], o, m.to(dt))
    return out.to(q.dtype), lse.float()


def masked_backward(
    kernel: BlockKernel,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    spans: Sequence[Span],
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of one masked block: ``dq`` like q, ``dk, dv`` like k, v (zero where no span
    reaches), from the queries' final ``out`` and ``lse``."""
    if len(spans) == 1 and spans[0].mode != "band":
        sp = spans[0]
        if (sp.q0, sp.q1, sp.k0, sp.k1) == (0, q.shape[0], 0, k.shape[0]):
            return kernel.backward(dout, q, k, v, out, lse, sp.mode == "causal", scale)
    if _varlen(q):
        return varlen_backward(dout, q, k, v, out, lse, spans, scale)
    dt = _work_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=dt, device=k.device)
    dv = torch.zeros(v.shape, dtype=dt, device=v.device)
    for sp in spans:
        qs, ks = slice(sp.q0, sp.q1), slice(sp.k0, sp.k1)
        args = (dout[qs], q[qs], k[ks], v[ks], out[qs], lse[qs])
        if sp.mode == "band":
            g = band_backward(*args, sp, scale)
        else:
            g = kernel.backward(*args, sp.mode == "causal", scale)
        dq[qs] += g[0]
        dk[ks] += g[1]
        dv[ks] += g[2]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


__all__ = ["band_backward", "band_forward", "masked_backward", "masked_forward"]
