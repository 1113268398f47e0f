"""Blocks inside a pass against blocks alone: the factor a CPU profile scales its blocks by.

Note [Blocks in a pass]
~~~~~~~~~~~~~~~~~~~~~~~
``calibrate`` times each block size by calling the kernel on the same tensors again and again
(:func:`~megatron_charm.sim.calibrate_worker.time_kernels`): warm caches, one shape, nothing
else running. In a pass the kernel gets inputs that have just arrived in fresh buffers, the
executor and the transport run between its calls, and on the CPU testbed other ranks' processes
take the same cores and caches in turns. On the testbed (2026-12-06, 512 tokens per rank,
scripts/bench/blocks_in_pass.py) the kernel's calls took 4-22% more CPU inside charm passes
than the fitted blocks alone give them, 23-24% with grouped-query heads, 25-40% inside ring's
(more and smaller calls); where eight ranks keep the two cores busy such CPU is the pass's
time, and replays without it came out 6-12% too fast there (docs/results/calibrated-2x2.md,
"Blocks in a pass").

So on a CPU host ``calibrate`` also runs passes of the real attention (``HOST_METHODS``, every
rank at once) with the kernel's calls timed on the calling thread
(:func:`~megatron_charm.sim.calibrate_worker.time_blocks_in_passes`), and the fit compares them
with what the fitted blocks alone give the same passes' blocks, per pass direction. It does so in
rounds (``--in-pass-rounds``, five by default) and takes each sample's median over them: on the
testbed one sample's five rounds spread by 0.05-0.22 around ratios of 0.88-1.32 (three
calibrations of 2026-12-06, whose profiles keep the rounds), as much as the factor moved between
calibrations of one round:

    in_pass = sum over the passes of (kernel CPU seconds measured, per rank)
              / sum over the passes of (the replay's block seconds, per rank)

The replay scales every block time and per-call overhead by it
(``FittedCompute.fwd_in_pass`` / ``bwd_in_pass``). A GPU's kernel time is not a thread's CPU
time, so GPU profiles keep 1.

Known limits: one factor per direction, from one shape (the configured heads, as many kv heads,
512 tokens), pooled over ring and charm; the measured ratio is larger for small and many calls
and for grouped-query heads than that, and on eight ranks than on the four it is measured on.
"""

from __future__ import annotations

import statistics

from megatron_charm.plan import PlanOptions
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Layout
from megatron_charm.sim.compute import FittedCompute
from megatron_charm.sim.engine import Engine
from megatron_charm.sim.programs import programs
from megatron_charm.sim.topology import Topology


def pass_block_seconds(
    compute: FittedCompute, method: str, layout: Layout, shape: AttnShape, backward: bool
) -> float:
    """Seconds the replay gives the blocks of one causal pass of ``method`` (default options)
    on ``layout`` with ``shape`` per rank, the mean over the ranks: their time alone where
    ``compute``'s own in-pass factors are 1."""
    progs = programs(PlanOptions(method=method), layout, True, "full", shape)
    # links do not price blocks; any will do
    topo = Topology(
        num_nodes=layout.num_nodes, ranks_per_node=layout.ranks_per_node, intra_bw=1.0, cross_bw=1.0
    )
    eng = Engine(progs, topo, shape, compute, backward)
    per_rank = [
        sum(c for ins, c in zip(instrs, costs, strict=True) if isinstance(ins, Compute))
        for instrs, costs in zip(eng.instrs, eng.costs, strict=True)
    ]
    return statistics.mean(per_rank)


def fit_in_pass(
    samples: list[dict],
    compute: FittedCompute,
    layout: Layout,
    batch: int,
    heads: int,
    head_dim: int,
) -> tuple[float, float, float]:
    """``(forward, backward, residual)`` of Note [Blocks in a pass] from ``samples`` of
    :func:`~megatron_charm.sim.calibrate_worker.time_blocks_in_passes` (``method``,
    ``s_local``, ``backward``, ``cpu_s``), against ``compute`` as fitted (its own factors 1);
    ``residual``: how far one method's ratio lies from its direction's factor, at most. A
    direction without samples keeps 1."""
    ratios: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for s in samples:
        shape = AttnShape(batch, s["s_local"], heads, heads, head_dim)
        model = pass_block_seconds(compute, s["method"], layout, shape, s["backward"])
        if model > 0 and s["cpu_s"] > 0:
            ratios[bool(s["backward"])].append((s["cpu_s"], model))
    factors, worst = [], 0.0
    for backward in (False, True):
        got = ratios[backward]
        if not got:
            factors.append(1.0)
            continue
        factor = sum(cpu for cpu, _ in got) / sum(model for _, model in got)
        factors.append(factor)
        worst = max(worst, *(abs(cpu / model / factor - 1.0) for cpu, model in got))
    return factors[0], factors[1], worst
