"""The causal symmetric replay against the full one: the largest error of each method and pass.

Above the full-replay limit the simulator replays node 0 only (Note [Node symmetry] in
``megatron_charm/sim/programs.py``); under causal attention that is an approximation (Note [Each
side its own size] in ``megatron_charm/sim/engine.py``). This replays both ways, on:

* 4 x 2, 4 x 4, 8 x 2 and 8 x 4 groups of a small shape (2 x 256 tokens a rank, 96 / 48 heads of
  64) on four link models: one NIC per GPU, one shared link per node, two NICs per node, a PCIe
  node behind one root complex; and the testbed's links between pairs of nodes, first come first
  served, reported apart;
* the H100 preset on 4 x 8 and 8 x 8 with 8, 2 and 1 cross links per node, 4,096 tokens a rank,
  16 heads of 64 (``tasp`` only up to 32 ranks: its full replay of 64 takes minutes).

``--large`` replays instead the groups that ``--mode auto`` replays for one node only, above 128
ranks, and 16 x 8 below them: the H100 preset with its two cross links per node on 16 x 8, 32 x 8
and 64 x 8, 4,096 tokens a rank, 16 heads of 128, the methods whose replay is approximate there
(every rank's plan of 512 ranks takes about a minute to build).

Run: ``python scripts/bench/symmetric_error.py [--large] [--md FILE]`` (about a minute on 2
cores; ``--large`` about six).
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Iterator

from megatron_charm.bench.report import emit
from megatron_charm.plan import AttnShape, PlanOptions
from megatron_charm.plan.types import Layout
from megatron_charm.sim.compute import ComputeModel, FlopsCompute
from megatron_charm.sim.engine import simulate_pass
from megatron_charm.sim.predict import Problem
from megatron_charm.sim.programs import node_programs, programs, symmetry_of
from megatron_charm.sim.topology import PRESETS, Topology

METHODS = ("charm", "rm+", "merge", "all_gather", "tasp", "ring", "a2a+p2p")
SMALL = AttnShape(b=2, s_local=256, h=96, h_kv=48, d=64)
SMALL_COMPUTE = FlopsCompute(tflops=100.0, efficiency=0.5, mem_bw=1000.0)
LINKS = {
    "one NIC per GPU": {"cross_links": "rails"},
    "one shared link": {"cross_links": "shared"},
    "two NICs per node": {"cross_links": "rails", "nics_per_node": 2},
    "PCIe domain": {"cross_links": "shared", "fabric": "pcie", "pcie_domain": 24.0},
    "pairs of nodes, FIFO": {"cross_links": "shared", "cross_mesh": True, "cross_fifo": True},
}


def cases() -> Iterator[tuple[str, Topology, AttnShape, ComputeModel]]:
    """``(link model, topology, shape, compute)`` of every group replayed."""
    for m, p in ((4, 2), (4, 4), (8, 2), (8, 4)):
        for name, links in LINKS.items():
            yield name, Topology(m, p, 100.0, 10.0, **links), SMALL, SMALL_COMPUTE
    hw = PRESETS["H100"]
    for nics in (8, 2, 1):
        for m in (4, 8):
            shape = Problem(1, 4096 * m * 8, 16, 64, causal=True).shape(m * 8)
            topo = hw.topology(m, 8, nics_per_node=nics)
            yield f"H100, cross links per node: {nics}", topo, shape, hw.compute_model(0.68)


LARGE_METHODS = ("charm", "rm+", "merge", "all_gather")


def large_cases() -> Iterator[tuple[str, Topology, AttnShape, ComputeModel]]:
    """The H100 preset's groups of 16 x 8 to 64 x 8 (``--large``)."""
    hw = PRESETS["H100"]
    for m in (16, 32, 64):
        shape = Problem(1, 4096 * m * 8, 16, 128, causal=True).shape(m * 8)
        yield "H100 preset", hw.topology(m, 8), shape, hw.compute_model(0.68)


def errors(large: bool = False) -> dict[tuple[str, str, bool], tuple[float, str]]:
    """``(family, method, backward) -> (largest error, where)``; family: the FIFO pair links
    or the others."""
    worst: dict[tuple[str, str, bool], tuple[float, str]] = {}
    for name, topo, shape, compute in large_cases() if large else cases():
        layout = Layout(topo.num_nodes, topo.ranks_per_node)
        family = "pairs of nodes" if topo.cross_mesh else "the other links"
        for method in LARGE_METHODS if large else METHODS:
            if symmetry_of(method, layout, True) is None or (
                method == "tasp" and layout.cp_size > 32
            ):
                continue
            options = PlanOptions(method=method)
            full = programs(options, layout, True, "full")
            sym = node_programs(options, layout, True)
            for backward in (False, True):
                a = simulate_pass(full, topo, shape, compute, backward).makespan
                b = simulate_pass(sym, topo, shape, compute, backward).makespan
                err = b / a - 1
                key = (family, method, backward)
                if key not in worst or abs(err) > abs(worst[key][0]):
                    worst[key] = (err, f"{layout.num_nodes} x {layout.ranks_per_node}, {name}")
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large", action="store_true", help="16 x 8 to 64 x 8 on the H100 preset")
    ap.add_argument("--md", help="write the table here as well")
    args = ap.parse_args()
    now = datetime.datetime.now(datetime.timezone.utc)
    worst = errors(args.large)
    command = "python scripts/bench/symmetric_error.py" + (" --large" if args.large else "")
    lines = [
        "Causal symmetric replay (node 0) against the full replay: the largest error of each "
        f"method and pass ({now:%Y-%m-%d %H:%M} UTC; `{command}`)",
        "",
        "| links | method | pass | largest error | where |",
        "|---|---|---|---|---|",
    ]
    for (family, method, backward), (err, where) in sorted(worst.items()):
        pass_ = "backward" if backward else "forward"
        lines.append(f"| {family} | {method} | {pass_} | {err:+.1%} | {where} |")
    emit("\n".join(lines), args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
