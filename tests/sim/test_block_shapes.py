"""Blocks priced by their shape: a cost per call, per row element and per FLOP (Note [Block
shapes] in sim/compute.py), fitted on blocks timed at more than one head count."""

from __future__ import annotations

import pytest

from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Heads, Part
from megatron_charm.sim.calibrate_worker import kernel_shapes
from megatron_charm.sim.compute import FittedCompute, block_elements
from megatron_charm.sim.profile import (
    block_elements_full,
    block_flops_full,
    fit_kernel,
    fit_nonnegative,
    fit_profile,
)
from tests.sim.test_profile import _raw

# the "true" machine: a small call cost, a large cost per row element (the CPU kernel's float32
# backward accumulators), FLOPs at a rate
OVER, PER_ELEMENT, RATE = 3e-4, 4e-9, 6e11
SHAPES = [(h, t) for h in (1, 8) for t in (256, 512, 1024, 2048)]


def _samples(shapes=SHAPES, over=OVER, per_element=PER_ELEMENT) -> list[dict]:
    out = []
    for heads, tokens in shapes:
        flops = block_flops_full(1, heads, 64, tokens)
        rows = block_elements_full(1, heads, 64, tokens)
        out.append(
            {
                "batch": 1,
                "heads": heads,
                "head_dim": 64,
                "tokens": tokens,
                "fwd_s": over + rows * per_element + flops / RATE,
                "bwd_s": 2 * over + 2 * rows * per_element + 2.5 * flops / RATE,
                "fwd_masked_s": 0.9 * (over + rows * per_element + flops / RATE),
                "bwd_masked_s": 0.8 * (2 * over + 2 * rows * per_element + 2.5 * flops / RATE),
            }
        )
    return out


def test_the_fit_recovers_the_call_the_rows_and_the_rate() -> None:
    over, per_element, per_flop, worst = fit_kernel(_samples(), backward=False)
    assert over == pytest.approx(OVER, rel=1e-6)
    assert per_element == pytest.approx(PER_ELEMENT, rel=1e-6)
    assert 1.0 / per_flop == pytest.approx(RATE, rel=1e-6) and worst < 1e-9
    over, per_element, per_flop, _ = fit_kernel(_samples(), backward=True)
    assert (over, per_element) == pytest.approx((2 * OVER, 2 * PER_ELEMENT), rel=1e-6)
    assert 1.0 / per_flop == pytest.approx(RATE, rel=1e-6)


def test_without_a_row_cost_the_fit_is_the_call_and_the_rate() -> None:
    samples = _samples(shapes=[(8, t) for t in (256, 512, 1024, 2048)], per_element=0.0)
    over, per_element, per_flop, _ = fit_kernel(samples, backward=False)
    assert over == pytest.approx(OVER, rel=1e-6) and per_element == pytest.approx(0.0, abs=1e-15)
    assert 1.0 / per_flop == pytest.approx(RATE, rel=1e-6)


def test_a_negative_coefficient_is_dropped_and_the_rest_refitted() -> None:
    # y = 2x exactly but for noise that a free fit answers with a negative intercept
    feats = [(1.0, x) for x in (1.0, 2.0, 3.0)]
    c0, c1 = fit_nonnegative(feats, [1.9, 4.1, 6.3], drop_order=(0,))
    assert c0 == 0.0 and c1 == pytest.approx(2.009, abs=0.001)
    # one size and one head count cannot tell the features apart: only the FLOPs stay
    one = _samples(shapes=[(8, 512)])
    over, per_element, per_flop, worst = fit_kernel(one, backward=False)
    assert (over, per_element) == (0.0, 0.0) and worst == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="positive samples"):
        fit_nonnegative(feats, [1.0, 0.0, 2.0], drop_order=(0,))


def test_a_head_split_block_pays_for_its_own_rows_only() -> None:
    shape = AttnShape(1, 1024, 8, 8, 64, 2)
    model = FittedCompute(RATE, RATE, fwd_overhead=OVER, fwd_per_element=PER_ELEMENT)
    whole = Compute(0, 1, Part.FULL, Part.FULL, False)
    split = Compute(0, 1, Part.FULL, Part.FULL, False, Heads(1, 8))  # one head of eight
    assert block_elements(whole, shape) == 2 * 1024 * 8 * 64
    assert block_elements(split, shape) == 2 * 1024 * 64
    # whole: 0.3 ms + 1,048,576 elements x 4 ns + 4 * 1024 * 1024 * 8 * 64 = 2,147,483,648 FLOPs
    # at 600 GFLOP/s: 0.3 + 4.194304 + 3.579139 = 8.073443 ms
    assert model.block_time(whole, shape, False) == pytest.approx(8.073443e-3, rel=1e-6)
    # one head: 0.3 ms (the call is paid whole) + 131,072 x 4 ns + 268,435,456 FLOPs at 600
    # GFLOP/s: 0.3 + 0.524288 + 0.447392 = 1.271680 ms
    assert model.block_time(split, shape, False) == pytest.approx(1.271680e-3, rel=1e-6)
    # GQA: kv rows count the kv heads
    gqa = AttnShape(1, 1024, 8, 2, 64, 2)
    half = Compute(0, 1, Part.FIRST, Part.FULL, False)
    assert block_elements(half, gqa) == 64 * (8 * 512 + 2 * 1024)


def test_calibrate_times_each_size_at_the_configured_and_the_extra_head_counts() -> None:
    cfg = {"heads": 8, "kernel_heads": [1, 8], "tokens": [256, 512]}
    assert kernel_shapes(cfg) == [(1, 256), (1, 512), (8, 256), (8, 512)]
    assert kernel_shapes({"heads": 4, "tokens": [256]}) == [(4, 256)]


def test_a_profile_fitted_on_two_head_counts_keeps_one_masked_ratio_per_size() -> None:
    raw = _raw()
    raw["kernel"] = _samples()
    compute = fit_profile(raw).compute_model()
    assert compute.fwd_per_element == pytest.approx(PER_ELEMENT, rel=1e-6)
    assert compute.bwd_overhead == pytest.approx(2 * OVER, rel=1e-6)
    assert [c[0] for c in compute.masked_cost] == [256, 512, 1024, 2048]
    assert all(c[1:] == pytest.approx((0.9, 0.8)) for c in compute.masked_cost)


def test_the_comparison_script_refits_blocks_the_old_way() -> None:
    from tests.bench_scripts import load_bench_script

    mod = load_bench_script("kernel_fit_ab")
    raw = _raw()
    raw["kernel"] = _samples(per_element=0.0)  # call + FLOPs: the old form fits it exactly
    prof = fit_profile(raw)
    as_json = {**prof.__dict__, "provenance": {"samples": {"kernel": raw["kernel"]}}}
    old = mod.refit(as_json)["compute"]
    assert old["fwd_per_element"] == 0.0 and old["bwd_per_element"] == 0.0
    assert old["fwd_overhead"] == pytest.approx(OVER, rel=1e-6)
    assert old["bwd_overhead"] == pytest.approx(2 * OVER, rel=1e-6)
    assert old["fwd_flops_per_s"] == pytest.approx(RATE, rel=1e-6)
    # with a real cost per row, timed at eight heads only, the call absorbs it
    raw["kernel"] = _samples()
    as_json["provenance"]["samples"]["kernel"] = raw["kernel"]
    assert mod.refit(as_json)["compute"]["bwd_overhead"] > 2 * OVER
