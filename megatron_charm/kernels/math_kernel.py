"""The float64 reference block kernel: explicit softmax. For tests and float64 inputs only; it
materialises ``[b, h, s_q, s_k]`` scores in float64.

:func:`explicit_forward` / :func:`explicit_backward` are the same softmax for any mask ``keep``
and work dtype; the masked kernel's band spans use them off CPU
(:mod:`megatron_charm.kernels.masked`).
"""

from __future__ import annotations

import torch

from megatron_charm.kernels.heads import expand_kv_heads, fold_kv_heads

Tensor = torch.Tensor


def _scores(q: Tensor, k: Tensor, keep: Tensor | None, scale: float, dt: torch.dtype) -> Tensor:
    s = torch.einsum("qbhd,kbhd->bhqk", q.to(dt), k.to(dt)) * scale
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _causal(q: Tensor, k: Tensor, causal: bool) -> Tensor | None:
    """The causal ``keep`` mask on local positions (``None`` when not causal)."""
    if not causal:
        return None
    return torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()


def explicit_forward(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, scale: float, dt: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Softmax attention in ``dt`` under ``keep`` (``[s_q, s_k]`` bool, ``None``: all pairs):
    ``out`` in q's dtype (zero on rows without keys) and ``lse`` float32 ``[s_q, b, h]``
    (``-inf`` there). Shapes as :func:`math_forward`."""
    h = q.shape[2]
    k, v = expand_kv_heads(k, h), expand_kv_heads(v, h)
    s = _scores(q, k, keep, scale, dt)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)  # rows without keys: -inf - -inf
    out = torch.einsum("bhqk,kbhd->qbhd", p, v.to(dt))
    return out.to(q.dtype), lse.permute(2, 0, 1).float()


def explicit_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    keep: Tensor | None,
    scale: float,
    dt: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients in ``dt`` of :func:`explicit_forward`, given the queries' final ``out`` and
    ``lse``: ``dq [s_q, b, h, d]``, ``dk, dv [s_k, b, h_kv, d]``."""
    h, hkv = q.shape[2], k.shape[2]
    ke, ve = expand_kv_heads(k, h).to(dt), expand_kv_heads(v, h).to(dt)
    s = _scores(q, ke, keep, scale, dt)
    p = torch.exp(s - lse.permute(1, 2, 0).to(dt).unsqueeze(-1))
    do = dout.to(dt)
    dv = torch.einsum("bhqk,qbhd->kbhd", p, do)
    dp = torch.einsum("qbhd,kbhd->bhqk", do, ve)
    delta = (do * out.to(dt)).sum(-1).permute(1, 2, 0).unsqueeze(-1)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhqk,kbhd->qbhd", ds, ke)
    dk = torch.einsum("bhqk,qbhd->kbhd", ds, q.to(dt))
    return dq, fold_kv_heads(dk, hkv), fold_kv_heads(dv, hkv)


def math_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``q [s_q, b, h, d]``, ``k, v [s_k, b, h_kv, d]`` -> ``out [s_q, b, h, d]`` in q's dtype,
    ``lse`` float32 ``[s_q, b, h]``."""
    return explicit_forward(q, k, v, _causal(q, k, causal), scale, torch.float64)


def math_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``dq [s_q, b, h, d]``, ``dk, dv [s_k, b, h_kv, d]`` given the final ``out``
    ``[s_q, b, h, d]`` and ``lse`` ``[s_q, b, h]`` of the queries."""
    keep = _causal(q, k, causal)
    dq, dk, dv = explicit_backward(dout, q, k, v, out, lse, keep, scale, torch.float64)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
