"""Block kernels against the float64 math reference, and the fp32 merge of partials."""

from __future__ import annotations

import pytest
import torch

from megatron_charm.kernels import merge_partial, select_kernel
from megatron_charm.kernels.backends import _KERNELS
from megatron_charm.plan.layout import zigzag_positions


def _inputs(s_q, s_k, h, h_kv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda s, heads: torch.randn(s, 2, heads, 16, generator=g).to(dtype)  # noqa: E731
    return mk(s_q, h), mk(s_k, h_kv), mk(s_k, h_kv), mk(s_q, h)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_torch_kernel_matches_math(causal, h_kv):
    q, k, v, do = _inputs(12, 12 if causal else 6, 4, h_kv, torch.float32)
    scale = 0.3
    o_ref, l_ref = _KERNELS["math"].forward(q, k, v, causal, scale)
    o, lse = _KERNELS["torch"].forward(q, k, v, causal, scale)
    assert o.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, l_ref, atol=1e-5, rtol=1e-5)
    want = _KERNELS["math"].backward(do, q, k, v, o_ref, l_ref, causal, scale)
    got = _KERNELS["torch"].backward(do, q, k, v, o_ref, l_ref, causal, scale)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_math_kernel_gradients_match_autograd():
    q, k, v, do = _inputs(8, 8, 4, 2, torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = 0.25
    ke, ve = (t.repeat_interleave(2, dim=2) for t in (k, v))
    s = torch.einsum("qbhd,kbhd->bhqk", q, ke) * scale
    s = s.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", s.softmax(-1), ve)
    out.backward(do)
    o, lse = _KERNELS["math"].forward(q.detach(), k.detach(), v.detach(), True, scale)
    torch.testing.assert_close(o, out.detach())
    grads = _KERNELS["math"].backward(do, q.detach(), k.detach(), v.detach(), o, lse, True, scale)
    for g, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(g, t.grad)


def test_merge_of_disjoint_keys_equals_joint_attention():
    q, k, v, _ = _inputs(6, 10, 4, 4, torch.float64, seed=3)
    math = _KERNELS["math"]
    o_all, l_all = math.forward(q, k, v, False, 0.5)
    o_a, l_a = math.forward(q, k[:4], v[:4], False, 0.5)
    o_b, l_b = math.forward(q, k[4:], v[4:], False, 0.5)
    acc_o, acc_l = o_a.float(), l_a.clone()
    merge_partial(acc_o, acc_l, o_b, l_b)
    torch.testing.assert_close(acc_o.double(), o_all, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(acc_l.double(), l_all.double(), atol=1e-6, rtol=1e-6)


def test_merge_into_empty_accumulator_is_exact():
    o_b = torch.randn(3, 1, 2, 4)
    l_b = torch.randn(3, 1, 2)
    acc_o = torch.zeros_like(o_b)
    acc_l = torch.full_like(l_b, float("-inf"))
    merge_partial(acc_o, acc_l, o_b, l_b)
    assert torch.equal(acc_o, o_b) and torch.equal(acc_l, l_b)


def test_kernel_selection_and_override():
    cpu = torch.device("cpu")
    assert select_kernel(cpu, torch.bfloat16).name == "torch"
    assert select_kernel(cpu, torch.float64).name == "math"
    assert select_kernel(cpu, torch.float32, "math").name == "math"
    with pytest.raises(ValueError, match="flash_attn"):
        select_kernel(cpu, torch.bfloat16, "flash_attn")
    with pytest.raises(ValueError, match="unknown block kernel"):
        select_kernel(cpu, torch.bfloat16, "xformers")


def test_zigzag_positions():
    assert zigzag_positions(0, 4, 16) == [0, 1, 14, 15]
    assert zigzag_positions(3, 4, 16) == [6, 7, 8, 9]
    every = sorted(p for r in range(4) for p in zigzag_positions(r, 4, 16))
    assert every == list(range(16))
    with pytest.raises(ValueError, match=r"divisible by 2 \* cp_size = 8"):
        zigzag_positions(0, 4, 12)


def test_cpu_half_blocks_are_computed_in_float32_and_rounded():
    """fp16 blocks on CPU, and bf16 blocks on CPUs without bf16 arithmetic, run the float32
    kernel (Note in torch_kernel.CPU_UPCAST): the same numbers as the float32 call on the same
    values, rounded to the input dtype. bf16 blocks on CPUs with it run in bf16, within bf16's
    rounding of that result."""
    from megatron_charm.kernels.torch_kernel import (
        cpu_bf16_native,
        cpu_compute_dtype,
        torch_backward,
        torch_forward,
    )

    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(16, 1, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(16, 1, 2, 8, generator=g) for _ in range(2))
    assert cpu_compute_dtype(torch.float16) == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        qh, kh, vh, doh = (t.to(dtype) for t in (q, k, v, do))
        out, lse = torch_forward(qh, kh, vh, True, 0.3)
        ref_out, ref_lse = torch_forward(*(t.float() for t in (qh, kh, vh)), True, 0.3)
        grads = torch_backward(doh, qh, kh, vh, out, lse, True, 0.3)
        ref = torch_backward(*(t.float() for t in (doh, qh, kh, vh, out)), lse, True, 0.3)
        if dtype == torch.bfloat16 and cpu_bf16_native():
            assert cpu_compute_dtype(dtype) == dtype
            assert out.dtype == dtype and lse.dtype == torch.float32
            torch.testing.assert_close(out.float(), ref_out, atol=3e-2, rtol=3e-2)
            torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-2)
            for got, want in zip(grads, ref, strict=True):
                assert got.dtype == dtype
                torch.testing.assert_close(got.float(), want, atol=6e-2, rtol=6e-2)
            continue
        assert cpu_compute_dtype(dtype) == torch.float32
        assert out.dtype == dtype and torch.equal(out, ref_out.to(dtype))
        assert torch.equal(lse, ref_lse)
        for got, want in zip(grads, ref, strict=True):
            assert got.dtype == dtype and torch.equal(got, want.to(dtype))


def test_cpu_flags_name_the_bf16_instructions():
    from megatron_charm.kernels.torch_kernel import BF16_CPU_FLAGS, cpu_flags

    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t: x\n"
    bf16 = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_tile\n"
    assert cpu_flags(avx2) == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert not cpu_flags(avx2) & BF16_CPU_FLAGS
    assert cpu_flags(bf16) & BF16_CPU_FLAGS == {"avx512_bf16"}
    assert cpu_flags("no flags here") == frozenset()
