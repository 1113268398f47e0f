"""One block under a document mask: the dense kernel per span, merged (forward and backward).

A masked block is a list of :class:`megatron_charm.plan.docmask.Span` rectangles (Note [Block
spans]). ``full`` and ``causal`` spans run the block kernel as it is, unmasked or causal; ``band``
spans (sliding windows) run :func:`band_forward` / :func:`band_backward`: on CPU PyTorch's flash
op with the band as an additive mask, elsewhere the math kernel's explicit softmax in float32
(float64 for float64 inputs). Rows that no span covers keep
``lse = -inf`` and a zero output, which the merge of partials treats as "no keys"
(:func:`megatron_charm.kernels.merge.merge_partial`); their gradients are zero.

Shapes are the block kernel's: ``q [s_q, b, h, d]``, ``k, v [s_k, b, h_kv, d]``, ``out`` like q,
``lse`` float32 ``[s_q, b, h]``. On CUDA in fp16/bf16 the spans that FlashAttention-2's varlen
mode can run go first, a few launches per block, into the same accumulators (Note [Varlen spans]
in :mod:`megatron_charm.kernels.varlen`); the loop here runs the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_charm.kernels import torch_kernel
from megatron_charm.kernels.backends import BlockKernel
from megatron_charm.kernels.math_kernel import explicit_backward, explicit_forward
from megatron_charm.kernels.merge import merge_partial
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


def _cpu_bias(span: Span, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The additive mask of a span for the CPU flash op, and which rows have no key."""
    keep = _band_keep(span, torch.device("cpu"))
    work = torch_kernel.cpu_compute_dtype(dtype)
    bias = torch.zeros(keep.shape, dtype=work).masked_fill_(~keep, -torch.inf)
    return bias, ~keep.any(dim=1)


def band_forward(
    q: Tensor, k: Tensor, v: Tensor, span: Span, scale: float
) -> tuple[Tensor, Tensor]:
    """A ``band`` span: ``out`` in q's dtype (zero on rows without keys), ``lse`` float32
    (``-inf`` there). On CPU PyTorch's flash op with an additive mask; elsewhere (and for
    float64) an explicit softmax."""
    if q.device.type == "cpu" and q.dtype != torch.float64:
        bias, empty = _cpu_bias(span, q.dtype)
        out, lse = torch_kernel.cpu_forward(q, k, v, False, scale, bias)
        lse = lse.float().masked_fill(empty[:, None, None], -torch.inf)
        return out.masked_fill(empty[:, None, None, None], 0.0), lse
    return explicit_forward(q, k, v, _band_keep(span, q.device), scale, _work_dtype(q.dtype))


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
        return torch_kernel.cpu_backward(dout, q, k, v, out, lse, False, scale, bias)
    keep = _band_keep(span, q.device)
    return explicit_backward(dout, q, k, v, out, lse, keep, scale, _work_dtype(q.dtype))


def _whole(spans: Sequence[Span], q: Tensor, k: Tensor) -> Span | None:
    """The one unbanded span that covers the whole block, which the dense kernel runs as is."""
    if len(spans) != 1 or spans[0].mode == "band":
        return None
    sp = spans[0]
    return sp if (sp.q0, sp.q1, sp.k0, sp.k1) == (0, q.shape[0], 0, k.shape[0]) else None


def masked_forward(
    kernel: BlockKernel, q: Tensor, k: Tensor, v: Tensor, spans: Sequence[Span], scale: float
) -> tuple[Tensor, Tensor]:
    """Forward of one masked block: ``out`` in q's dtype, ``lse`` float32 (``-inf`` on rows
    without keys)."""
    whole = _whole(spans, q, k)
    if whole is not None:
        return kernel.forward(q, k, v, whole.mode == "causal", scale)
    dt = _work_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=dt, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=dt, device=q.device)
    if _varlen(q):  # the spans FlashAttention-2 can run go first, in few launches
        spans = varlen_forward(out, lse, q, k, v, spans, scale)
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
    whole = _whole(spans, q, k)
    if whole is not None:
        return kernel.backward(dout, q, k, v, out, lse, whole.mode == "causal", scale)
    dt = _work_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=dt, device=k.device)
    dv = torch.zeros(v.shape, dtype=dt, device=v.device)
    if _varlen(q):
        spans = varlen_backward(dq, dk, dv, dout, q, k, v, out, lse, spans, scale)
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
