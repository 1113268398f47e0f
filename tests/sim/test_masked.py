"""Masked blocks cost what the kernel computes (Note [Masked blocks] in sim/compute.py)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Part
from megatron_charm.sim.compute import FittedCompute
from megatron_charm.sim.profile import block_flops_full, fit_profile, load_profile

SHAPE = AttnShape(1, 1024, 8, 8, 64, 2)
BASE = FittedCompute(3e10, 2e10, fwd_overhead=2e-4, bwd_overhead=5e-4)
COST = ((256, 1.0, 0.9), (1024, 0.6, 0.5))
OWN = Compute(0, 0, Part.FULL, Part.FULL, True)  # a rank's own block: 1024 tokens, masked
HALF = Compute(0, 0, Part.FIRST, Part.FIRST, True)  # a half's diagonal: 512 tokens


def test_without_a_measurement_a_masked_block_is_half_the_flops() -> None:
    whole = dataclasses.replace(OWN, masked=False)
    fwd = BASE.block_time(OWN, SHAPE, False) - BASE.fwd_overhead
    assert fwd == pytest.approx((BASE.block_time(whole, SHAPE, False) - BASE.fwd_overhead) / 2)


def test_a_measured_ratio_scales_the_unmasked_time() -> None:
    model = dataclasses.replace(BASE, masked_cost=COST)
    for ins, ratio_f, ratio_b in ((OWN, 0.6, 0.5), (HALF, 0.8, 0.7)):  # 512: halfway in log2
        whole = dataclasses.replace(ins, masked=False)
        assert model.block_time(ins, SHAPE, False) == pytest.approx(
            ratio_f * model.block_time(whole, SHAPE, False)
        )
        assert model.block_time(ins, SHAPE, True) == pytest.approx(
            ratio_b * model.block_time(whole, SHAPE, True)
        )
    assert model.masked_ratio(64, False) == 1.0 and model.masked_ratio(8192, True) == 0.5
    # unmasked blocks are not affected
    whole = dataclasses.replace(OWN, masked=False)
    assert model.block_time(whole, SHAPE, False) == BASE.block_time(whole, SHAPE, False)


def test_a_bad_ratio_is_refused() -> None:
    with pytest.raises(ValueError, match="masked_cost"):
        dataclasses.replace(BASE, masked_cost=((256, 0.0, 0.5),))


def test_the_fit_keeps_the_measured_ratios(tmp_path) -> None:
    kernel = []
    for tokens, ratio in ((256, 1.0), (512, 0.95), (1024, 0.7), (2048, 0.6)):
        flops = block_flops_full(1, 8, 64, tokens)
        fwd, bwd = 2e-4 + flops / 3e10, 5e-4 + 2.5 * flops / 2e10
        kernel.append(
            {"batch": 1, "heads": 8, "head_dim": 64, "tokens": tokens, "fwd_s": fwd}
            | {"bwd_s": bwd, "fwd_masked_s": ratio * fwd, "bwd_masked_s": ratio * bwd}
        )
    link = [{"bytes": n, "s": 1e-4 + n / 1e9} for n in (65536, 1048576)]
    raw = {"nodes": 1, "ranks_per_node": 2, "kernel": kernel, "merge": link}
    raw["p2p"] = {"intra": link}
    prof = fit_profile(raw)
    cost = prof.compute_model().masked_cost
    assert [(t, round(f, 6), round(b, 6)) for t, f, b in cost] == [
        (256, 1.0, 1.0),
        (512, 0.95, 0.95),
        (1024, 0.7, 0.7),
        (2048, 0.6, 0.6),
    ]
    path = tmp_path / "p.json"
    prof.save(path)
    assert load_profile(str(path)).compute_model().masked_cost == cost
    # samples without masked timings (older calibrations): the half rule
    for k in kernel:
        del k["fwd_masked_s"], k["bwd_masked_s"]
    assert fit_profile(raw).compute_model().masked_cost == ()
