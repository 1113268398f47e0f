"""docs/results/window-rule.md: the default window is the smallest one within 1% of the best
predicted time. One point of its grid, so a planner change that breaks the rule fails here."""

from __future__ import annotations

from megatron_charm.plan import PlanOptions
from megatron_charm.sim.compute import FlopsCompute
from megatron_charm.sim.predict import Problem, predict
from megatron_charm.sim.topology import PRESETS, Topology


def test_default_window_is_the_smallest_as_fast_as_any():
    hw = PRESETS["L20"]
    topo = Topology(2, 4, hw.intra_bw, hw.cross_bw, nics_per_node=hw.nics_per_node)
    compute = FlopsCompute(hw.tflops, hw.efficiency, mem_bw=hw.mem_bw)
    problem = Problem(1, 2048 * 8, 32, 128, kv_heads=8, causal=True)
    times = {}
    for w in (1, 2, 3):
        res = predict(topo, problem, compute, ("charm",), options=PlanOptions(window=w))
        times[w] = res.methods["charm"].total
    default = PlanOptions().window
    best = min(times.values())
    assert times[default] <= 1.01 * best
    assert all(times[w] > 1.01 * best for w in times if w < default)
