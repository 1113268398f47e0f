"""Single-process references on the gathered (global) sequence."""

from __future__ import annotations

import torch

from megatron_charm.plan.layout import sequence_positions


def naive_attention(q, k, v, causal: bool, scale: float, upcast: bool, allowed=None):
    """Plain attention on ``[b, S, h, d]`` tensors; returns out and lse ``[b, h, S]``.

    ``upcast=True`` computes in float64 (the reference); ``False`` stays in the input dtype (the
    "naive implementation in the same precision" that bounds acceptable low-precision error).
    ``allowed``: an ``[S, S]`` bool mask (query i may attend key j), applied with ``causal``.
    """
    dt = torch.float64 if upcast else q.dtype
    h = q.shape[2]
    k = k.repeat_interleave(h // k.shape[2], dim=2)
    v = v.repeat_interleave(h // v.shape[2], dim=2)
    qq, kk, vv = (t.to(dt).transpose(1, 2) for t in (q, k, v))
    s = (qq @ kk.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s.float() if not upcast else s, dim=-1)
    p = torch.softmax(s, dim=-1)
    out = (p @ vv).transpose(1, 2)
    return out, lse


def local_index(cp_rank: int, cp_size: int, seq: int, causal: bool, seq_layout: str):
    """Global positions of ``cp_rank``'s local tokens: causal inputs in the method's
    ``seq_layout`` (``zigzag`` or ``contiguous``), non-causal ones contiguous (any layout
    serves)."""
    return torch.tensor(
        sequence_positions(cp_rank, cp_size, seq, seq_layout if causal else "contiguous")
    )


def error_bound(dtype: str, naive: float, magnitude: float, floor: float = 0.0) -> float:
    """The gloo tier's tolerance: float32 within 1e-4 relative to the reference's magnitude (at
    least 1); low precision twice the naive same-dtype error plus one rounding of the largest
    value, that value taken as at least ``floor``."""
    if dtype == "float32":
        return 1e-4 * max(1.0, magnitude)
    return 2 * naive + torch.finfo(getattr(torch, dtype)).eps * max(magnitude, floor)
