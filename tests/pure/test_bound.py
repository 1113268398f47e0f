"""Note [The dependency-aware bound]: the lower bound the attention benchmark divides by."""

from __future__ import annotations

import pytest

from megatron_charm.bench.accounting import dependency_bound_s, lower_bound_s, method_bytes
from megatron_charm.plan import Layout, PlanOptions, build_plan
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.validate import validate

RATE = 100e6  # bit/s


def _bounds(layout, causal, shape, topology, compute_s, backward, **opts):
    plan = build_plan(PlanOptions(method="charm", **opts), layout, causal, shape)
    lb = method_bytes("charm", layout, causal, shape, topology, plan.options)
    key = "bwd" if backward else "fwd"
    byte = lower_bound_s(compute_s, lb[key].max_cross_link, RATE)
    report = validate(plan)[backward]
    return plan, byte, dependency_bound_s(plan, report, backward, shape, topology, compute_s, RATE)


@pytest.mark.parametrize("layout", [Layout(2, 2), Layout(2, 4), Layout(4, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("topology", ["shared", "rails"])
@pytest.mark.parametrize("backward", [False, True])
def test_never_below_the_byte_bound_and_at_most_one_compute_above(
    layout, causal, kv_heads, topology, backward
):
    shape = AttnShape(1, 2048, 8, kv_heads, 64, 2)
    compute_s = 0.2
    _, byte, dep = _bounds(layout, causal, shape, topology, compute_s, backward)
    assert dep >= byte
    # a chain is a link's bytes plus the smallest foreign block, which is less than a pass
    assert dep <= byte + compute_s


def test_kv_forward_has_no_chain():
    """kv crossing in the forward returns nothing, so only the bytes bound it."""
    shape = AttnShape(1, 2048, 8, 2, 64, 2)
    plan, byte, dep = _bounds(Layout(2, 2), True, shape, "shared", 0.2, False)
    assert plan.cross[0] == "kv"
    assert dep == byte


def test_rails_query_forward_pays_the_first_piece():
    """2 x 2 rails, MHA, q across in the forward: rail 0 carries q0.second out, o2.first and
    o2.second back; the results cannot leave before the first foreign query half arrived
    (1 MiB) and was computed, so the bound is the link's bytes plus one block's compute."""
    shape = AttnShape(1, 2048, 8, 8, 64, 2)
    plan, byte, dep = _bounds(Layout(2, 2), True, shape, "rails", 0.2, False, cross_level="q")
    assert plan.cross[0] == "q"
    mib = 2**20
    results = 2 * (mib + 2048 // 2 * 8 * 4)  # o2.first, o2.second with their float32 lse
    assert byte == pytest.approx((mib + results) * 8 / RATE)
    extra = dep - byte
    assert 0 < extra < 0.2
    # halving the compute halves the chain's compute term
    _, _, dep_half = _bounds(Layout(2, 2), True, shape, "rails", 0.1, False, cross_level="q")
    assert dep_half - byte == pytest.approx(extra / 2)


def test_no_rate_is_compute_only():
    shape = AttnShape(1, 2048, 8, 8, 64, 2)
    plan = build_plan(PlanOptions(method="charm"), Layout(2, 2), True, shape)
    assert dependency_bound_s(plan, validate(plan)[0], False, shape, "shared", 0.3, 0) == 0.3
