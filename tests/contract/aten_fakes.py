"""CPU reference implementations of the CUDA-only ATen attention ops, with the checks their CUDA
kernels make (layouts, dtypes, head-dim multiple of 8, dense vs varlen branch), computed with the
float64 math kernel. Used through :class:`tests.contract.schema.RecordingOps`."""

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


def flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                  return_debug_mask, scale, **_):  # fmt: skip
    if cum_seq_q is not None or cum_seq_k is not None:
        raise RuntimeError("defined cum_seq_q/k: ATen would run the varlen kernel")
    _check_flash_inputs(query, key, value)
    b, s_q, h, _ = query.shape
    assert key.shape[2] and h % key.shape[2] == 0 and (max_q, max_k) == (s_q, key.shape[1])
    assert dropout_p == 0.0 and not return_debug_mask
    out, lse = math_forward(_sb(query), _sb(key), _sb(value), is_causal, scale)
    rng = torch.zeros(2, dtype=torch.uint64)
    return _sb(out), lse.permute(1, 2, 0), rng, torch.zeros((), dtype=torch.uint64), query[:0]


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                   dropout_p, is_causal, rng_state, unused, scale, **_):  # fmt: skip
    if cum_seq_q is not None or cum_seq_k is not None:
        raise RuntimeError("defined cum_seq_q/k: ATen would run the varlen backward")
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
