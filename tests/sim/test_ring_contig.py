"""The contiguous ring in the simulator: its causal time is the last rank's."""

from __future__ import annotations

import pytest

from megatron_charm.plan import AttnShape, Layout, PlanOptions
from megatron_charm.plan.types import Compute, Part
from megatron_charm.sim import FlopsCompute, Problem, Topology, advise, predict
from megatron_charm.sim.engine import simulate_pass
from megatron_charm.sim.programs import node_programs, programs, symmetry_of

SHAPE = AttnShape(b=1, s_local=512, h=4, h_kv=2, d=64)
COMPUTE = FlopsCompute(tflops=100.0, efficiency=0.5, mem_bw=1e12)
FREE_LINKS = Topology(1, 8, 1e9, 1e9, intra_lat=0.0, cross_lat=0.0)


def _makespans(method: str, topo: Topology, causal: bool) -> tuple[float, float]:
    progs = programs(
        PlanOptions(method=method), Layout(topo.num_nodes, topo.ranks_per_node), causal
    )
    return tuple(
        simulate_pass(progs, topo, SHAPE, COMPUTE, backward).makespan for backward in (False, True)
    )


@pytest.mark.parametrize("backward", [False, True])
def test_causal_time_is_the_last_ranks_blocks(backward: bool) -> None:
    # With free links each rank is its compute: the last computes n - 1 full blocks and its
    # diagonal, the zigzag ring n half blocks on every rank.
    n = FREE_LINKS.cp_size
    full = COMPUTE.block_time(Compute(0, 0, Part.FULL, Part.FULL, False), SHAPE, backward)
    progs = programs(PlanOptions(method="ring-contig"), Layout(1, n), True)
    res = simulate_pass(progs, FREE_LINKS, SHAPE, COMPUTE, backward)
    assert res.makespan == pytest.approx((n - 0.5) * full, rel=1e-3)
    busy = [r.busy for r in res.ranks]
    assert busy.index(max(busy)) == n - 1 and busy.index(min(busy)) == 0
    ring = simulate_pass(
        programs(PlanOptions(method="ring"), Layout(1, n), True),
        FREE_LINKS,
        SHAPE,
        COMPUTE,
        backward,
    )
    assert ring.makespan == pytest.approx(n * 0.5 * full, rel=1e-3)


@pytest.mark.parametrize(
    "topo", [FREE_LINKS, Topology(2, 4, 300.0, 25.0), Topology(1, 4, 50.0, 50.0)]
)
def test_slower_than_zigzag_ring_when_causal_equal_when_full(topo: Topology) -> None:
    contig, ring = _makespans("ring-contig", topo, True), _makespans("ring", topo, True)
    assert all(c > r for c, r in zip(contig, ring, strict=True))
    assert _makespans("ring-contig", topo, False) == _makespans("ring", topo, False)


def test_causal_ring_contig_is_replayed_in_full() -> None:
    layout = Layout(16, 8)
    assert symmetry_of("ring-contig", layout, causal=True) is None
    assert symmetry_of("ring-contig", layout, causal=False) == "shift"
    with pytest.raises(ValueError, match="causal ring-contig has none"):
        node_programs(PlanOptions(method="ring-contig"), layout, True)


def test_advise_never_recommends_ring_contig() -> None:
    # non-causal: ring-contig ties ring exactly; Megatron could not run it anyway
    pred = predict(Topology(2, 4, 300.0, 25.0), Problem(1, 8192, 8, 64), COMPUTE)
    assert pred.methods["ring-contig"].total == pred.methods["ring"].total
    assert advise(pred).method != "ring-contig"
