"""The float64 reference block kernel: explicit softmax. For tests and float64 inputs only; it
materialises ``[b, h, s_q, s_k]`` scores in float64."""

from __future__ import annotations

import torch

from megatron_charm.kernels.heads import expand_kv_heads, fold_kv_heads

Tensor = torch.Tensor


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    s = torch.einsum("qbhd,kbhd->bhqk", q.double(), k.double()) * scale
    if causal:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def math_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``q [s_q, b, h, d]``, ``k, v [s_k, b, h_kv, d]`` -> ``out [s_q, b, h, d]`` in q's dtype,
    ``lse`` float32 ``[s_q, b, h]``."""
    h = q.shape[2]
    k, v = expand_kv_heads(k, h), expand_kv_heads(v, h)
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("bhqk,kbhd->qbhd", p, v.double())
    return out.to(q.dtype), lse.permute(2, 0, 1).float()


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
    h, hkv = q.shape[2], k.shape[2]
    ke, ve = expand_kv_heads(k, h).double(), expand_kv_heads(v, h).double()
    s = _scores(q, ke, causal, scale)
    p = torch.exp(s - lse.permute(1, 2, 0).double().unsqueeze(-1))
    do = dout.double()
    dv = torch.einsum("bhqk,qbhd->kbhd", p, do)
    dp = torch.einsum("qbhd,kbhd->bhqk", do, ve)
    delta = (do * out.double()).sum(-1).permute(1, 2, 0).unsqueeze(-1)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhqk,kbhd->qbhd", ds, ke)
    dk = torch.einsum("bhqk,qbhd->kbhd", ds, q.double())
    return dq.to(q.dtype), fold_kv_heads(dk, hkv).to(k.dtype), fold_kv_heads(dv, hkv).to(v.dtype)
