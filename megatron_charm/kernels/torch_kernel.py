"""The ``torch`` block kernel: PyTorch's own attention ops, no extra package.

* CPU, any float dtype: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward; fp16
  blocks, and bf16 blocks on CPUs without bf16 arithmetic, are computed in float32 and rounded
  back (see :data:`CPU_UPCAST`).
* CUDA, fp16/bf16: ``_flash_attention_forward`` / ``_flash_attention_backward`` (FlashAttention-2
  inside PyTorch; native GQA).
* CUDA, fp32: ``_scaled_dot_product_efficient_attention`` with ``compute_log_sumexp=True`` and its
  backward (the memory-efficient kernel; kv heads are expanded for it, it has no GQA).

Block contract (all paths): ``q [s_q, b, h, d]``, ``k, v [s_k, b, h_kv, d]`` -> ``out`` like q and
``lse`` float32 ``[s_q, b, h]``; the backward takes the *final* ``out``/``lse`` of the queries and
returns ``dq`` like q and ``dk, dv`` like k, v. The CUDA functions take any device whose tensors the
op accepts, so that they can be run on ``meta`` tensors against the ops' schemas on a CPU machine.
"""

from __future__ import annotations

import functools

import torch

from megatron_charm.kernels.heads import expand_kv_heads, fold_kv_heads, pad_head_dim

Tensor = torch.Tensor

#: The op namespace used by the CUDA paths (a module attribute so that contract tests can record
#: the calls and bind them to the real schemas).
_ops = torch.ops.aten

#: The memory-efficient kernel stores lse padded to a multiple of this along the query axis.
EFFICIENT_LSE_ALIGN = 32


def _bhsd(t: Tensor) -> Tensor:
    return t.permute(1, 2, 0, 3)


def _sbhd(t: Tensor) -> Tensor:
    return t.permute(2, 0, 1, 3)


# --- CPU -----------------------------------------------------------------------------------


@functools.cache
def cpu_native_gqa() -> bool:
    """Whether this torch's CPU flash op takes fewer kv heads than query heads (torch >= 2.5 does).

    Probed once on a tiny input against the expanded call, since older releases may reject or
    misread the shapes.
    """
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 4, 8, generator=g) for n in (2, 1, 1))
    try:
        got, _ = _ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=0.5)
        k2, v2 = (t.expand(1, 2, 4, 8) for t in (k, v))
        want, _ = _ops._scaled_dot_product_flash_attention_for_cpu(q, k2, v2, 0.0, False, scale=0.5)
    except RuntimeError:
        return False
    return bool(torch.allclose(got, want, atol=1e-6))


#: Half-precision blocks run in float32 on CPU, unless the CPU computes bf16 natively
#: (:func:`cpu_bf16_native`). PyTorch's CPU flash kernel has no fast bf16/fp16 path on CPUs
#: without AVX512-BF16/AMX: on an AVX2 EPYC core (1024 tokens, 8 heads of 64, causal) bf16 took
#: 80 ms forward and 812 ms backward, float32 40 ms and 99 ms. The half kernel accumulates in
#: float32 too, so the results differ only in where they are rounded.
CPU_UPCAST = {torch.bfloat16: torch.float32, torch.float16: torch.float32}

#: CPU flags with which bf16 blocks run in bf16: on an AVX512-BF16 EPYC core (same block) bf16
#: took 20 ms forward and 32 ms backward, float32 19 ms and 49 ms, before the two casts.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in ``/proc/cpuinfo`` text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_bf16_native() -> bool:
    """Whether this CPU has bf16 arithmetic that PyTorch's CPU kernels use (AVX512-BF16 or
    AMX-BF16, from ``/proc/cpuinfo``; ``False`` where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
    except OSError:
        return False
    return bool(cpu_flags(text) & BF16_CPU_FLAGS)


def cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the CPU path computes ``dtype`` inputs in (:data:`CPU_UPCAST`)."""
    if dtype == torch.bfloat16 and cpu_bf16_native():
        return dtype
    return CPU_UPCAST.get(dtype, dtype)


def _cpu_compute(*tensors: Tensor) -> list[Tensor]:
    return [t.to(cpu_compute_dtype(t.dtype)) for t in tensors]


def _cpu_kv(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    if cpu_native_gqa():
        return k, v
    return expand_kv_heads(k, heads), expand_kv_heads(v, heads)


def cpu_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """CPU path of :func:`torch_forward` (shapes there). ``bias``: an additive float mask
    ``[s_q, s_k]`` (``-inf``: masked) in the compute dtype; the op returns a zero output and a
    zero lse on rows it masks entirely, which callers must mark themselves."""
    k, v = _cpu_kv(k, v, q.shape[2])
    qc, kc, vc = _cpu_compute(q, k, v)
    out, lse = _ops._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(qc), _bhsd(kc), _bhsd(vc), 0.0, causal, attn_mask=bias, scale=scale
    )
    return _sbhd(out).to(q.dtype), lse.permute(2, 0, 1)


def cpu_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """CPU path of :func:`torch_backward`:

    dout, q, out ``[s_q, b, h, d]``; k, v ``[s_k, b, h_kv, d]``; lse float32 ``[s_q, b, h]``
    -> ``dq [s_q, b, h, d]``, ``dk, dv [s_k, b, h_kv, d]`` (details there;
    ``bias`` as :func:`cpu_forward`)."""
    hkv = k.shape[2]
    ke, ve = _cpu_kv(k, v, q.shape[2])
    doc, qc, kc, vc, oc = _cpu_compute(dout, q, ke, ve, out)
    dq, dk, dv = _ops._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(doc),
        _bhsd(qc),
        _bhsd(kc),
        _bhsd(vc),
        _bhsd(oc),
        lse.permute(1, 2, 0).contiguous(),
        0.0,
        causal,
        attn_mask=bias,
        scale=scale,
    )
    dk, dv = fold_kv_heads(_sbhd(dk), hkv), fold_kv_heads(_sbhd(dv), hkv)
    return _sbhd(dq).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --- CUDA, fp16/bf16: PyTorch's FlashAttention-2 ---------------------------------------------


def _bshd8(t: Tensor) -> Tensor:
    """``[s, b, h, d]`` -> ``[b, s, h, d8]`` (a view unless d needs padding to a multiple of 8)."""
    return pad_head_dim(t.transpose(0, 1))


def cuda_flash_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """fp16/bf16 CUDA path of :func:`torch_forward` (shapes there)."""
    d = q.shape[-1]
    out, lse, _rng, _unused, _mask = _ops._flash_attention_forward.default(
        _bshd8(q),
        _bshd8(k),
        _bshd8(v),
        None,  # cum_seq_q: None selects the dense (not varlen) kernel
        None,
        q.shape[0],
        k.shape[0],
        0.0,
        causal,
        False,
        scale=scale,
    )
    return out[..., :d].transpose(0, 1), lse.permute(2, 0, 1)


def cuda_flash_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """fp16/bf16 CUDA path of :func:`torch_backward`:

    dout, q, out ``[s_q, b, h, d]``; k, v ``[s_k, b, h_kv, d]``; lse float32 ``[s_q, b, h]``
    -> ``dq [s_q, b, h, d]``, ``dk, dv [s_k, b, h_kv, d]`` (details there)."""
    d = q.shape[-1]
    # rng_state/unused are read only with dropout; pass what the forward returns for p = 0.
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = _ops._flash_attention_backward.default(
        _bshd8(dout),
        _bshd8(q),
        _bshd8(k),
        _bshd8(v),
        _bshd8(out),
        lse.permute(1, 2, 0).contiguous(),
        # None, not an empty tensor: ATen takes the varlen branch for any *defined* cum_seq_q.
        None,
        None,
        q.shape[0],
        k.shape[0],
        0.0,
        causal,
        rng,
        unused,
        scale=scale,
    )
    return tuple(g[..., :d].transpose(0, 1) for g in (dq, dk, dv))  # type: ignore[return-value]


# --- CUDA, fp32: the memory-efficient kernel ----------------------------------------------------


def _eff_in(t: Tensor) -> Tensor:
    """``[s, b, h, d]`` -> ``[b, h, s, d8]`` view of a ``[b, s, h, d8]``-contiguous tensor, the
    layout SDPA hands this kernel."""
    return pad_head_dim(t.transpose(0, 1)).contiguous().transpose(1, 2)


def cuda_efficient_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """fp32 CUDA path of :func:`torch_forward` (shapes there)."""
    h, d, sq = q.shape[2], q.shape[-1], q.shape[0]
    k, v = expand_kv_heads(k, h), expand_kv_heads(v, h)
    out, lse, _seed, _offset = _ops._scaled_dot_product_efficient_attention.default(
        _eff_in(q), _eff_in(k), _eff_in(v), None, True, 0.0, causal, scale=scale
    )
    # lse is [b, h, round_up(s_q, 32)]; the padded tail is not ours.
    return _sbhd(out[..., :d]), lse[..., :sq].permute(2, 0, 1)


def cuda_efficient_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 CUDA path of :func:`torch_backward`:

    dout, q, out ``[s_q, b, h, d]``; k, v ``[s_k, b, h_kv, d]``; lse float32 ``[s_q, b, h]``
    -> ``dq [s_q, b, h, d]``, ``dk, dv [s_k, b, h_kv, d]`` (details there)."""
    h, hkv, d, sq = q.shape[2], k.shape[2], q.shape[-1], q.shape[0]
    ke, ve = expand_kv_heads(k, h), expand_kv_heads(v, h)
    b = q.shape[1]
    rows = -(-sq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN
    # Give the backward lse in the forward's own padded layout.
    ll = torch.zeros(b, h, rows, dtype=torch.float32, device=q.device)
    ll[..., :sq] = lse.permute(1, 2, 0)
    # philox seed/offset are read only with dropout; the forward returns int64 scalars for p = 0.
    seed = torch.zeros((), dtype=torch.int64)
    offset = torch.zeros((), dtype=torch.int64)
    dq, dk, dv, _dbias = _ops._scaled_dot_product_efficient_attention_backward.default(
        _eff_in(dout),
        _eff_in(q),
        _eff_in(ke),
        _eff_in(ve),
        None,  # attn_bias: none
        _eff_in(out),
        ll,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    dq, dk, dv = (_sbhd(g[..., :d]) for g in (dq, dk, dv))
    return dq, fold_kv_heads(dk, hkv), fold_kv_heads(dv, hkv)


# --- dispatch -----------------------------------------------------------------------------------


def _cuda_path(dtype: torch.dtype) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        return "flash"
    if dtype == torch.float32:
        return "efficient"
    raise ValueError(
        f"the torch block kernel on CUDA takes float16, bfloat16 or float32, got {dtype}; cast "
        "q, k, v or use kernel='math' (float64 reference)"
    )


def torch_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Block forward.

    Args:
        q: ``[s_q, b, h, d]``; k, v: ``[s_k, b, h_kv, d]`` with ``h % h_kv == 0``; causal only
            with ``s_q == s_k`` (local positions).

    Returns:
        ``out [s_q, b, h, d]`` in q's dtype and ``lse`` float32 ``[s_q, b, h]``.
    """
    if not q.is_cuda:
        return cpu_forward(q, k, v, causal, scale)
    if _cuda_path(q.dtype) == "flash":
        return cuda_flash_forward(q, k, v, causal, scale)
    return cuda_efficient_forward(q, k, v, causal, scale)


def torch_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Block backward.

    Args:
        dout, q, out: ``[s_q, b, h, d]``; k, v: ``[s_k, b, h_kv, d]``; lse: float32 ``[s_q, b, h]``
            (out and lse are the queries' final, merged values).

    Returns:
        ``dq [s_q, b, h, d]``, ``dk, dv [s_k, b, h_kv, d]``.
    """
    if not q.is_cuda:
        return cpu_backward(dout, q, k, v, out, lse, causal, scale)
    if _cuda_path(q.dtype) == "flash":
        return cuda_flash_backward(dout, q, k, v, out, lse, causal, scale)
    return cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale)
