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

The layers merge into the block's own accumulators (:mod:`megatron_charm.kernels.masked`), which
then runs the spans whose band cannot be written so (a negative left or right) like any other
span. FlashAttention-2 gives rows without keys a zero output and ``lse = +inf``; they are set to
``-inf`` here, the merge's "no keys". Backward runs the same layers with the queries' final out
and lse, and adds the packed gradients back with ``index_put_(accumulate=True)`` (kv rows may
repeat).

Tensors as in :mod:`megatron_charm.kernels.masked`: ``q [s_q, b, h, d]``, ``k, v [s_k, b, h_kv,
d]`` (fp16/bf16, CUDA); ``lse`` float32 ``[s_q, b, h]``; packed rows are gathered by ``(row,
batch entry)`` index pairs, no reshaping of the block.
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
    """One layer's sequences: ``(row, batch entry)`` indices of the packed q and kv rows into
    ``[s, b, ...]`` tensors, and cumulative lengths."""

    q_idx: tuple[Tensor, Tensor]
    k_idx: tuple[Tensor, Tensor]
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int


def _pack(layer: Sequence[Span], b: int, device: torch.device) -> _Packed:
    q_rows, q_bat, k_rows, k_bat, cu_q, cu_k = [], [], [], [], [0], [0]
    for sp in layer:
        for bi in range(b):
            q_rows.append(torch.arange(sp.q0, sp.q1))
            q_bat.append(torch.full((sp.q1 - sp.q0,), bi))
            k_rows.append(torch.arange(sp.k0, sp.k1))
            k_bat.append(torch.full((sp.k1 - sp.k0,), bi))
            cu_q.append(cu_q[-1] + sp.q1 - sp.q0)
            cu_k.append(cu_k[-1] + sp.k1 - sp.k0)

    def dev(parts: list[Tensor], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.cat(parts).to(device, dtype, non_blocking=True)

    return _Packed(
        (dev(q_rows), dev(q_bat)),
        (dev(k_rows), dev(k_bat)),
        dev([torch.tensor(cu_q)], torch.int32),
        dev([torch.tensor(cu_k)], torch.int32),
        max(sp.q1 - sp.q0 for sp in layer),
        max(sp.k1 - sp.k0 for sp in layer),
    )


def _window_kwargs(left: int, right: int) -> dict:
    return {"window_size_left": left, "window_size_right": right}


def varlen_forward(
    out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, spans: Sequence[Span], scale: float
) -> list[Span]:
    """Merge the spans FlashAttention-2 can run into the block's float32 accumulators ``out``
    ``[s_q, b, h, d]`` and ``lse`` ``[s_q, b, h]``; return the spans it cannot run."""
    d = q.shape[-1]
    todo, rest = layers(spans)
    for (causal, left, right), layer in todo:
        pk = _pack(layer, q.shape[1], q.device)
        o, m, _rng, _unused, _mask = torch_kernel._ops._flash_attention_forward.default(
            pad_head_dim(q[pk.q_idx]),
            pad_head_dim(k[pk.k_idx]),
            pad_head_dim(v[pk.k_idx]),
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
        acc_o, acc_l = out[pk.q_idx], lse[pk.q_idx]  # copies: no row twice in a layer
        merge_partial(acc_o, acc_l, o, m)
        out[pk.q_idx], lse[pk.q_idx] = acc_o, acc_l
    return rest


def varlen_backward(
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    spans: Sequence[Span],
    scale: float,
) -> list[Span]:
    """Add the gradients of the spans FlashAttention-2 can run, from the queries' final ``out``
    and ``lse``, into the float32 accumulators ``dq`` (like q) and ``dk, dv`` (like k, v);
    return the spans it cannot run."""
    d = q.shape[-1]
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    todo, rest = layers(spans)
    for (causal, left, right), layer in todo:
        pk = _pack(layer, q.shape[1], q.device)
        g = torch_kernel._ops._flash_attention_backward.default(
            pad_head_dim(dout[pk.q_idx]),
            pad_head_dim(q[pk.q_idx]),
            pad_head_dim(k[pk.k_idx]),
            pad_head_dim(v[pk.k_idx]),
            pad_head_dim(out[pk.q_idx]),
            lse[pk.q_idx].transpose(0, 1).contiguous(),  # [h, total_q]
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
        # kv rows may repeat in a layer: accumulate
        dq.index_put_(pk.q_idx, g[0][..., :d].float(), accumulate=True)
        dk.index_put_(pk.k_idx, g[1][..., :d].float(), accumulate=True)
        dv.index_put_(pk.k_idx, g[2][..., :d].float(), accumulate=True)
    return rest


__all__ = ["flash_window", "layers", "varlen_backward", "varlen_forward"]
