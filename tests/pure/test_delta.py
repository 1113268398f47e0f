"""Note [The backward bundle]: delta in place of out."""

from __future__ import annotations

import torch

from megatron_charm.kernels.delta import out_for_delta, row_delta


def test_out_for_delta_has_the_row_sums_of_the_real_out():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(6, 2, 3, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(6, 2, 3, 16, generator=g, dtype=torch.float64)
    delta = row_delta(out, dout)
    assert delta.dtype == torch.float32 and delta.shape == (6, 2, 3)
    fake = out_for_delta(dout, delta)
    assert fake.shape == dout.shape and fake.dtype == dout.dtype
    torch.testing.assert_close(row_delta(fake, dout), delta, rtol=1e-6, atol=0)


def test_bf16_expansion_reaches_float32_rounding():
    # three bf16 terms: delta to about float32's rounding, relative to delta itself
    g = torch.Generator().manual_seed(1)
    out = torch.randn(64, 1, 4, 64, generator=g)
    dout = torch.randn(64, 1, 4, 64, generator=g).bfloat16()
    delta = row_delta(out, dout)
    fake = out_for_delta(dout, delta)
    err = (row_delta(fake, dout) - delta).abs()
    assert bool((err <= 2.0**-21 * delta.abs() + 1e-30).all())


def test_zero_and_tiny_rows():
    dout = torch.zeros(2, 1, 2, 8)
    dout[0, 0, 0, 3] = 1e-30  # one non-zero entry: one term
    delta = torch.tensor([[[3e-30, 0.0]], [[0.0, 0.0]]])

    fake = out_for_delta(dout, delta)
    assert bool(torch.isfinite(fake).all())
    assert bool((fake[1] == 0).all()) and bool((fake[0, 0, 1] == 0).all())
    torch.testing.assert_close(row_delta(fake, dout), delta, rtol=1e-5, atol=0)


def test_one_key_per_query_cancels_exactly():
    # a window of 0: out = v for the one key, and dq = 0 exactly only if the kernel's delta
    # equals dout . v as it forms it; the expansion must give back that float32 sum
    g = torch.Generator().manual_seed(2)
    v = torch.randn(32, 1, 2, 64, generator=g).bfloat16()
    dout = torch.randn(32, 1, 2, 64, generator=g).bfloat16()
    delta = row_delta(v, dout)
    fake = out_for_delta(dout, delta)
    err = (row_delta(fake, dout) - delta).abs()
    assert bool((err <= 2.0**-22 * delta.abs()).all())


def test_fp16_terms_do_not_overflow():
    dout = torch.tensor([1.0, 1e-4, 1e-7, 0.0] + [0.0] * 4).half().reshape(1, 1, 1, 8)
    delta = torch.tensor([[[60000.0]]])
    fake = out_for_delta(dout, delta)
    assert bool(torch.isfinite(fake).all())
