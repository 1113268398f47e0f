"""Block attention backends.

Every backend computes one block: queries ``q [s_q, b, h, d]`` against keys and values
``k, v [s_k, b, h_kv, d]`` (``h % h_kv == 0``; kv heads are expanded inside the kernel so that kv
travels at ``h_kv`` heads), optionally causal on local positions (``s_q == s_k``). Forward returns
``out [s_q, b, h, d]`` in the input dtype and ``lse`` float32 ``[s_q, b, h]``. Backward takes the
*final* ``out`` and ``lse`` of the queries (not the block's own), so that block gradients sum to the
exact gradient.

Backends: ``torch`` (PyTorch's flash-attention ops: the CPU kernel on CPU, the CUDA kernel on CUDA),
``flash_attn`` (the flash-attn package, CUDA only, imported lazily) and ``math`` (explicit softmax
in float64: the reference for tests).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


def expand_kv_heads(t: Tensor, heads: int) -> Tensor:
    """``[x, y, h_kv, d]`` -> ``[x, y, heads, d]`` (query head ``i`` uses kv head ``i // g``)."""
    groups = heads // t.shape[2]
    return t if groups == 1 else t.repeat_interleave(groups, dim=2)


def fold_kv_heads(g: Tensor, kv_heads: int) -> Tensor:
    """Sum a gradient ``[x, y, h, d]`` over each kv head's query group -> ``[x, y, h_kv, d]``."""
    s, b, h, d = g.shape
    if h == kv_heads:
        return g
    return g.view(s, b, kv_heads, h // kv_heads, d).sum(dim=3)


def _bhsd(t: Tensor) -> Tensor:
    return t.permute(1, 2, 0, 3)


def _sbhd(t: Tensor) -> Tensor:
    return t.permute(2, 0, 1, 3)


# --- math (float64 reference) ---------------------------------------------------------------


def _math_scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    s = torch.einsum("qbhd,kbhd->bhqk", q.double(), k.double()) * scale
    if causal:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _math_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    h = q.shape[2]
    k, v = expand_kv_heads(k, h), expand_kv_heads(v, h)
    s = _math_scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("bhqk,kbhd->qbhd", p, v.double())
    return out.to(q.dtype), lse.permute(2, 0, 1).float()


def _math_bwd(dout, q, k, v, out, lse, causal, scale):
    h, hkv = q.shape[2], k.shape[2]
    ke, ve = expand_kv_heads(k, h).double(), expand_kv_heads(v, h).double()
    s = _math_scores(q, ke, causal, scale)
    p = torch.exp(s - lse.permute(1, 2, 0).double().unsqueeze(-1))
    do = dout.double()
    dv = torch.einsum("bhqk,qbhd->kbhd", p, do)
    dp = torch.einsum("qbhd,kbhd->bhqk", do, ve)
    delta = (do * out.double()).sum(-1).permute(1, 2, 0).unsqueeze(-1)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhqk,kbhd->qbhd", ds, ke)
    dk = torch.einsum("bhqk,qbhd->kbhd", ds, q.double())
    return dq.to(q.dtype), fold_kv_heads(dk, hkv).to(k.dtype), fold_kv_heads(dv, hkv).to(v.dtype)


# --- torch flash-attention ops ---------------------------------------------------------------


def _torch_fwd(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    h = q.shape[2]
    qq, kk, vv = _bhsd(q), _bhsd(expand_kv_heads(k, h)), _bhsd(expand_kv_heads(v, h))
    if q.is_cuda:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            qq, kk, vv, 0.0, causal, False, scale=scale
        )
        out, lse = res[0], res[1]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qq, kk, vv, 0.0, causal, attn_mask=None, scale=scale
        )
    return _sbhd(out), lse.permute(2, 0, 1)


def _torch_bwd(dout, q, k, v, out, lse, causal, scale):
    h, hkv = q.shape[2], k.shape[2]
    qq, kk, vv = _bhsd(q), _bhsd(expand_kv_heads(k, h)), _bhsd(expand_kv_heads(v, h))
    oo, do = _bhsd(out), _bhsd(dout)
    ll = lse.permute(1, 2, 0).contiguous()
    if q.is_cuda:
        sq, sk = q.shape[0], k.shape[0]
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, qq, kk, vv, oo, ll, empty, empty, sq, sk, 0.0, causal, seed, seed, scale=scale
        )
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, qq, kk, vv, oo, ll, 0.0, causal, attn_mask=None, scale=scale
        )
    return _sbhd(dq), fold_kv_heads(_sbhd(dk), hkv), fold_kv_heads(_sbhd(dv), hkv)


# --- flash-attn (CUDA, optional) ---------------------------------------------------------------


def _flash_attn_fwd(q, k, v, causal, scale):
    from flash_attn import flash_attn_func

    res = flash_attn_func(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        softmax_scale=scale,
        causal=causal,
        return_attn_probs=True,
    )
    out, lse = res[0], res[1]  # out [b, s, h, d]; lse [b, h, s]
    return out.transpose(0, 1), lse.permute(2, 0, 1)


def _flash_attn_bwd(dout, q, k, v, out, lse, causal, scale):
    from flash_attn.flash_attn_interface import _flash_attn_backward

    bs = lambda t: t.transpose(0, 1).contiguous()  # noqa: E731
    dq, dk, dv = torch.empty_like(bs(q)), torch.empty_like(bs(k)), torch.empty_like(bs(v))
    _flash_attn_backward(
        bs(dout),
        bs(q),
        bs(k),
        bs(v),
        bs(out),
        lse.permute(1, 2, 0).contiguous(),
        dq,
        dk,
        dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    )
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


@dataclass(frozen=True)
class BlockKernel:
    """A block attention backend (see the module docstring for shapes)."""

    name: str
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


_KERNELS = {
    "torch": BlockKernel("torch", _torch_fwd, _torch_bwd),
    "flash_attn": BlockKernel("flash_attn", _flash_attn_fwd, _flash_attn_bwd),
    "math": BlockKernel("math", _math_fwd, _math_bwd),
}


def available_kernels(device: torch.device) -> list[str]:
    names = ["torch", "math"]
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        names.insert(0, "flash_attn")
    return names


def select_kernel(device: torch.device, dtype: torch.dtype, name: str | None = None) -> BlockKernel:
    """Pick the block kernel once per (device, dtype); ``name`` (or env ``MEGATRON_CHARM_KERNEL``)
    overrides the choice."""
    import os

    name = name or os.environ.get("MEGATRON_CHARM_KERNEL") or None
    avail = available_kernels(device)
    # CUDA flash kernels take only half precision; float32/float64 on CUDA use the math kernel.
    half = dtype in (torch.float16, torch.bfloat16)
    if name is None:
        if dtype == torch.float64 or (device.type == "cuda" and not half):
            return _KERNELS["math"]
        return _KERNELS[avail[0]]
    if name not in _KERNELS:
        raise ValueError(
            f"unknown block kernel {name!r}; expected one of {sorted(_KERNELS)} "
            "(set kernel= or MEGATRON_CHARM_KERNEL)"
        )
    if device.type == "cuda" and name != "math" and not half:
        raise ValueError(
            f"block kernel {name!r} on CUDA needs float16 or bfloat16 inputs, got {dtype}; cast "
            "q, k, v or use kernel='math'"
        )
    if name not in avail:
        raise ValueError(
            f"block kernel {name!r} is not available on device {device}; available: {avail} "
            "(flash_attn needs CUDA and the flash-attn package: pip install 'megatron-charm[gpu]')"
        )
    return _KERNELS[name]
