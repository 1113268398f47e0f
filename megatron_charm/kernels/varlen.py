"""Masked blocks on CUDA in few launches: PyTorch's FlashAttention-2 with cumulative lengths.

Note [Varlen spans]
~~~~~~~~~~~~~~~~~~~
A masked block is a list of spans (Note [Block spans] in :mod:`megatron_charm.plan.docmask`).
FlashAttention-2's variable-length mode runs many (q segment, kv segment) pairs in one launch,
each with the same causal flag and window. So the spans are grouped by their flash window, and a
group is cut into *layers* in which no query row appears twice (a query run that meets two kv
runs of one group lands in two layers, whose results merge by lse like any partials). One launch
per layer, batch entries included (each span x batch entry is one sequence)::

    span rows [q0, q1) x columns [k0, k1), band lo <= shift + j - i <= hi
    flash:    j - i in [s_k - s_q - left, s_k - s_q + right]   (bottom-right aligned)
    =>        left = s_k - s_q + shift - lo,  right = hi - shift - (s_k - s_q)   (-1: unbounded)

A span whose band cannot be written so (a negative left or right) runs the explicit band kernel.
FlashAttention-2 gives rows without keys a zero output and ``lse = +inf``; they are set to
``-inf`` here, the merge's "no keys". Backward runs the same layers with the queries' final out
and lse, and adds the packed gradients back with ``index_add_`` (kv rows may repeat).

Tensors as in :mod:`megatron_charm.kernels.masked`: ``q [s_q, b, h, d]``, ``k, v [s_k, b, h_kv,
d]`` (fp16/bf16, CUDA); ``lse`` float32 ``[s_q, b, h]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_charm.kernels import torch_kernel
from megatron_charm.kernels.heads import pad_head_dim
from megatron_charm.kernels.merge import merge_partial
from megatron_charm.plan.docmask import Span

Tensor = torch.Tensor


def flash_window(span: Span) -> tuple[bool, int, int] | None:
    """``(is_causal, left, right)`` of a span for FlashAttention-2, or ``None`` when its band
    is not a bottom-right window."""
    s_q, s_k = span.q1 - span.q0, span.k1 - span.k0
    if span.mode == "full":
        return (False, -1, -1)
    if span.mode == "causal":
        return (True, -1, 0)
    diag = s_k - s_q
    left = -1 if span.lo == -math.inf else int(diag + span.shift - span.lo)
    right = -1 if span.hi == math.inf else int(span.hi - span.shift - diag)
    if (left < 0 and left != -1) or (right < 0 and right != -1):
        return None
    return (False, left, right)


def layers(spans: Sequence[Span]) -> tuple[list[tuple[tuple[bool, int, int], list[Span]]], list]:
    """Spans grouped by flash window and cut into layers without repeated query rows; and the
    spans flash cannot run."""
    groups: dict[tuple[bool, int, int], list[list[Span]]] = {}
    rest = []
    for sp in spans:
        key = flash_window(sp)
        if key is None:
            rest.append(sp)
            continue
        for layer in groups.setdefault(key, []):
            if all(sp.q1 <= o.q0 or o.q1 <= sp.q0 for o in layer):
                layer.append(sp)
                break
        else:
            groups[key].append([sp])
    return [(key, layer) for key, ls in groups.items() for layer in ls], rest


@dataclass
class _Packed:
    """One layer's sequences: flat row indices into ``[b * s, ...]`` and cumulative lengths."""

    q_rows: Tensor
    k_rows: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int


def _pack(layer: Sequence[Span], b: int, s_q: int, s_k: int, device: torch.device) -> _Packed:
    q_rows, k_rows, cu_q, cu_k = [], [], [0], [0]
    for sp in layer:
        for bi in range(b):
            q_rows.append(torch.arange(sp.q0, sp.q1) + bi * s_q)
            k_rows.append(torch.arange(sp.k0, sp.k1) + bi * s_k)
            cu_q.append(cu_q[-1] + sp.q1 - sp.q0)
            cu_k.append(cu_k[-1] + sp.k1 - sp.k0)

    def dev(x):
        return x.to(device, non_blocking=True)

    return _Packed(
        dev(torch.cat(q_rows)),
        dev(torch.cat(k_rows)),
        dev(torch.tensor(cu_q, dtype=torch.int32)),
        dev(torch.tensor(cu_k, dtype=torch.int32)),
        max(sp.q1 - sp.q0 for sp in layer),
        max(sp.k1 - sp.k0 for sp in layer),
    )


def _flat(t: Tensor) -> Tensor:
    """``[s, b, heads, d]`` -> ``[b * s, heads, d]`` (row ``bi * s + i``)."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


def _window_kwargs(left: int, right: int) -> dict:
    return {"window_size_left": left, "window_size_right": right}


def varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, spans: Sequence[Span], scale: float
) -> tuple[Tensor, Tensor]:
    """Forward of one masked block: ``out`` in q's dtype, ``lse`` float32 (``-inf`` on rows
    without keys)."""
    from megatron_charm.kernels.masked import band_forward

    s_q, b, h, d = q.shape
    s_k = k.shape[0]
    out = torch.zeros(b * s_q, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b * s_q, h), -math.inf, dtype=torch.float32, device=q.device)
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    todo, rest = layers(spans)
    for (causal, left, right), layer in todo:
        pk = _pack(layer, b, s_q, s_k, q.device)
        o, m, _rng, _unused, _mask = torch_kernel._ops._flash_attention_forward.default(
            pad_head_dim(qf[pk.q_rows]),
            pad_head_dim(kf[pk.k_rows]),
            pad_head_dim(vf[pk.k_rows]),
            pk.cu_q,
            pk.cu_k,
            pk.max_q,
            pk.max_k,
            0.0,
            causal,
            False,
            scale=scale,
            **_window_kwargs(left, right),
        )
        m = m.transpose(0, 1)  # [h, total_q] -> [total_q, h]
        empty = ~torch.isfinite(m)  # FlashAttention-2 marks rows without keys with +inf
        m = m.masked_fill(empty, -math.inf)
        o = o[..., :d].masked_fill(empty.unsqueeze(-1), 0.0)
        acc_o, acc_l = out[pk.q_rows], lse[pk.q_rows]
        merge_partial(acc_o, acc_l, o, m)
        out[pk.q_rows], lse[pk.q_rows] = acc_o, acc_l
    o4 = out.reshape(b, s_q, h, d).transpose(0, 1)
    l3 = lse.reshape(b, s_q, h).transpose(0, 1)
    for sp in rest:
        qs, ks = slice(sp.q0, sp.q1), slice(sp.k0, sp.k1)
        bo, bl = band_forward(q[qs], k[ks], v[ks], sp, scale)
        merge_partial(o4[qs], l3[qs], bo, bl)
    return o4.to(q.dtype).contiguous(), l3.contiguous()


def varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    spans: Sequence[Span],
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of one masked block from the queries' final ``out`` and ``lse``: ``dq`` like q,
    ``dk, dv`` like k, v."""
    from megatron_charm.kernels.masked import band_backward

    s_q, b, h, d = q.shape
    s_k = k.shape[0]
    dq = torch.zeros(b * s_q, h, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b * s_k, k.shape[2], d, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    qf, kf, vf, of, dof = (_flat(t) for t in (q, k, v, out, dout))
    lf = _flat(lse.unsqueeze(-1)).squeeze(-1)  # [b * s_q, h]
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    todo, rest = layers(spans)
    for (causal, left, right), layer in todo:
        pk = _pack(layer, b, s_q, s_k, q.device)
        g = torch_kernel._ops._flash_attention_backward.default(
            pad_head_dim(dof[pk.q_rows]),
            pad_head_dim(qf[pk.q_rows]),
            pad_head_dim(kf[pk.k_rows]),
            pad_head_dim(vf[pk.k_rows]),
            pad_head_dim(of[pk.q_rows]),
            lf[pk.q_rows].transpose(0, 1).contiguous(),  # [h, total_q]
            pk.cu_q,
            pk.cu_k,
            pk.max_q,
            pk.max_k,
            0.0,
            causal,
            rng,
            unused,
            scale=scale,
            **_window_kwargs(left, right),
        )
        dq.index_add_(0, pk.q_rows, g[0][..., :d].float())
        dk.index_add_(0, pk.k_rows, g[1][..., :d].float())
        dv.index_add_(0, pk.k_rows, g[2][..., :d].float())
    dq4 = dq.reshape(b, s_q, h, d).transpose(0, 1)
    dk4, dv4 = (t.reshape(b, s_k, k.shape[2], d).transpose(0, 1) for t in (dk, dv))
    for sp in rest:
        qs, ks = slice(sp.q0, sp.q1), slice(sp.k0, sp.k1)
        args = (dout[qs], q[qs], k[ks], v[ks], out[qs], lse[qs])
        gq, gk, gv = band_backward(*args, sp, scale)
        dq4[qs] += gq
        dk4[ks] += gk
        dv4[ks] += gv
    return dq4.to(q.dtype), dk4.to(k.dtype), dv4.to(v.dtype)


__all__ = ["flash_window", "layers", "varlen_backward", "varlen_forward"]
