"""CPU reference implementations of the CUDA-only ATen attention ops, with the checks their CUDA
kernels make (layouts, dtypes, head-dim multiple of 8, dense vs varlen branch), computed with the
float64 math kernel; the varlen branch (defined cumulative lengths) as FlashAttention-2 documents
it: ``[t, h, d]`` tensors, lse ``[h, t]``, bottom-right aligned causal and windows, and rows
without keys returning a zero output with ``lse = +inf``. Used through
:class:`tests.contract.schema.RecordingOps`."""

from __future__ import annotations

import torch

from megatron_charm.kernels.math_kernel import math_backward, math_forward

HALF = (torch.float16, torch.bfloat16)


def _sb(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1)  # [b, s, h, d] <-> [s, b, h, d]


def _check_flash_inputs(*ts: torch.Tensor) -> None:
    q = ts[0]
    assert q.dtype in HALF, f"flash kernel takes fp16/bf16, got {q.dtype}"
    for t in ts:
        assert t.dim() == 4 and t.dtype == q.dtype, "q, k, v, out, dout: 4-d, one dtype"
        assert t.stride(-1) == 1, "last dimension must be contiguous"
    assert q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, f"head_dim {q.shape[-1]}"


def _varlen_allowed(s_q: int, s_k: int, causal: bool, left, right) -> torch.Tensor:
    """FlashAttention-2's mask of one varlen sequence: bottom-right aligned causal / window."""
    left = -1 if left is None else left
    right = 0 if causal else (-1 if right is None else right)
    i = torch.arange(s_q).unsqueeze(1) + (s_k - s_q)
    j = torch.arange(s_k).unsqueeze(0)
    ok = torch.ones(s_q, s_k, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _check_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k):
    assert query.dim() == 3 and key.dim() == 3 and value.shape == key.shape, "varlen: [t, h, d]"
    assert query.dtype in HALF and key.dtype == query.dtype
    assert query.shape[-1] % 8 == 0 and query.shape[1] % key.shape[1] == 0
    for cu, t, mx in ((cum_seq_q, query, max_q), (cum_seq_k, key, max_k)):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and int(cu[0]) == 0
        assert int(cu[-1]) == t.shape[0], "cumulative lengths must end at the packed length"
        assert int((cu[1:] - cu[:-1]).max()) <= mx, "max_q/max_k below a sequence length"
    assert len(cum_seq_q) == len(cum_seq_k)


def flash_varlen_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                         scale, window_size_left=None, window_size_right=None):  # fmt: skip
    """FlashAttention-2 varlen: out [t_q, h, d]; lse [h, t_q]; rows without keys: out 0 and
    lse +inf, as FA2 writes them."""
    _check_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    h = query.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.full((h, query.shape[0]), float("inf"), dtype=torch.float64)
    for n in range(len(cum_seq_q) - 1):
        qs = slice(int(cum_seq_q[n]), int(cum_seq_q[n + 1]))
        ks = slice(int(cum_seq_k[n]), int(cum_seq_k[n + 1]))
        q, k, v = query[qs].double(), key[ks].double(), value[ks].double()
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
        ok = _varlen_allowed(q.shape[0], k.shape[0], is_causal, window_size_left, window_size_right)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        s = s.masked_fill(~ok, float("-inf"))
        m = torch.logsumexp(s, dim=-1)  # [h, s_q]
        p = torch.exp(s - m.unsqueeze(-1)).nan_to_num(0.0)
        out[qs] = torch.einsum("hqk,khd->qhd", p, v)
        lse[:, qs] = torch.where(torch.isfinite(m), m, torch.full_like(m, float("inf")))
    return out.to(query.dtype), lse.float()


def flash_varlen_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                          max_q, max_k, is_causal, scale, window_size_left=None,
                          window_size_right=None):  # fmt: skip
    _check_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    h, h_kv = query.shape[1], key.shape[1]
    assert logsumexp.shape == (h, query.shape[0]) and logsumexp.is_contiguous()
    dq = torch.zeros(query.shape, dtype=torch.float64)
    dk = torch.zeros(key.shape, dtype=torch.float64)
    dv = torch.zeros(key.shape, dtype=torch.float64)
    for n in range(len(cum_seq_q) - 1):
        qs = slice(int(cum_seq_q[n]), int(cum_seq_q[n + 1]))
        ks = slice(int(cum_seq_k[n]), int(cum_seq_k[n + 1]))
        q, do, o = query[qs].double(), grad_out[qs].double(), out[qs].double()
        k, v = (t[ks].double().repeat_interleave(h // h_kv, dim=1) for t in (key, value))
        ok = _varlen_allowed(q.shape[0], k.shape[0], is_causal, window_size_left, window_size_right)
        s = (torch.einsum("qhd,khd->hqk", q, k) * scale).masked_fill(~ok, float("-inf"))
        p = torch.exp(s - logsumexp[:, qs].double().unsqueeze(-1))
        dv_e = torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, v)
        delta = (do * o).sum(-1).transpose(0, 1).unsqueeze(-1)  # [h, s_q, 1]
        ds = p * (dp - delta) * scale
        dq[qs] = torch.einsum("hqk,khd->qhd", ds, k)
        dk_e = torch.einsum("hqk,qhd->khd", ds, q)
        fold = lambda t: t.reshape(t.shape[0], h_kv, h // h_kv, -1).sum(2)  # noqa: E731
        dk[ks] += fold(dk_e)
        dv[ks] += fold(dv_e)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                  return_debug_mask, scale, window_size_left=None, window_size_right=None,
                  **_):  # fmt: skip
    if cum_seq_q is not None or cum_seq_k is not None:
        assert cum_seq_q is not None and cum_seq_k is not None, "varlen needs both lengths"
        assert dropout_p == 0.0 and not return_debug_mask
        out, lse = flash_varlen_forward(
            query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
            window_size_left, window_size_right,
        )  # fmt: skip
        rng = torch.zeros(2, dtype=torch.uint64)
        return out, lse, rng, torch.zeros((), dtype=torch.uint64), query[:0]
    _check_flash_inputs(query, key, value)
    b, s_q, h, _ = query.shape
    assert key.shape[2] and h % key.shape[2] == 0 and (max_q, max_k) == (s_q, key.shape[1])
    assert dropout_p == 0.0 and not return_debug_mask
    out, lse = math_forward(_sb(query), _sb(key), _sb(value), is_causal, scale)
    rng = torch.zeros(2, dtype=torch.uint64)
    return _sb(out), lse.permute(1, 2, 0), rng, torch.zeros((), dtype=torch.uint64), query[:0]


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                   dropout_p, is_causal, rng_state, unused, scale, window_size_left=None,
                   window_size_right=None, **_):  # fmt: skip
    if cum_seq_q is not None or cum_seq_k is not None:
        assert rng_state.dtype == torch.uint64 and dropout_p == 0.0
        return flash_varlen_backward(
            grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
            is_causal, scale, window_size_left, window_size_right,
        )  # fmt: skip
    _check_flash_inputs(query, key, value, out, grad_out)
    b, s_q, h, _ = query.shape
    assert logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
    assert logsumexp.shape == (b, h, s_q), f"lse {tuple(logsumexp.shape)}"
    assert rng_state.dtype == torch.uint64 and dropout_p == 0.0
    grads = math_backward(
        _sb(grad_out), _sb(query), _sb(key), _sb(value), _sb(out), logsumexp.permute(2, 0, 1),
        is_causal, scale,
    )  # fmt: skip
    return tuple(_sb(g) for g in grads)


EFF_ALIGN = 32


def efficient_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal,
                      scale, **_):  # fmt: skip
    assert query.dtype == torch.float32 and attn_bias is None and compute_log_sumexp
    for t in (query, key, value):
        assert t.dim() == 4 and t.stride(-1) == 1
    b, h, s_q, d = query.shape
    assert key.shape[1] == h, "the memory-efficient kernel has no GQA: expand kv heads"
    bs = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731 - [b, h, s, d] -> [s, b, h, d]
    out, lse = math_forward(bs(query), bs(key), bs(value), is_causal, scale)
    rows = -(-s_q // EFF_ALIGN) * EFF_ALIGN
    # The tail past s_q is not attention; NaN makes any use of it visible.
    lse_pad = torch.full((b, h, rows), float("nan"))
    lse_pad[..., :s_q] = lse.permute(1, 2, 0)
    seed = torch.zeros((), dtype=torch.int64)
    return out.permute(1, 2, 0, 3), lse_pad, seed, seed.clone()


def efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed,
                       philox_offset, dropout_p, grad_input_mask, is_causal, scale,
                       **_):  # fmt: skip
    assert query.dtype == torch.float32 and attn_bias is None and dropout_p == 0.0
    b, h, s_q, d = query.shape
    assert key.shape[1] == h, "the memory-efficient kernel has no GQA: expand kv heads"
    assert logsumexp.shape == (b, h, -(-s_q // EFF_ALIGN) * EFF_ALIGN), "lse in forward layout"
    assert list(grad_input_mask) == [True, True, True, False]
    bs = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731
    grads = math_backward(
        bs(grad_out_), bs(query), bs(key), bs(value), bs(out),
        logsumexp[..., :s_q].permute(2, 0, 1), is_causal, scale,
    )  # fmt: skip
    return (*(g.permute(1, 2, 0, 3) for g in grads), None)


IMPL = {
    "_flash_attention_forward": flash_forward,
    "_flash_attention_backward": flash_backward,
    "_scaled_dot_product_efficient_attention": efficient_forward,
    "_scaled_dot_product_efficient_attention_backward": efficient_backward,
}
