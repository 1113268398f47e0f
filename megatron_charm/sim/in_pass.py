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

Note [Transport in a pass]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The transport's threads (gloo's copies and TCP work) are fitted on passes whose kernel computes
nothing (Note [Host work of a call] in :mod:`megatron_charm.sim.profile`): every rank only
communicates, and the transfers run back to back. In a pass whose ranks compute, the same
threads wake between other processes' blocks on the same cores, and took 1.2-1.7 times the
fitted CPU on the testbed (2026-12-06 18:15-18:26 UTC, scripts/bench/blocks_in_pass.py, charm
and ring at 512 tokens on the profiles' own layouts and link rate, two runs each: 2 x 2
`xeon-g` 1.35 and 1.61 for charm, 1.42 and 1.22 for ring; 2 x 4 `xeon-h` 1.69 and 1.50, 1.45
and 1.30), and twice it on 4 x 2 at 200 Mbit/s. There the host is the bottleneck, and the
replay of charm's forward came out 28% too fast (docs/results/calibrated-2x2.md, "The
transport in a pass").

The same passes as above also record the CPU seconds of the calling thread and of the whole
process; their difference is the transport's. The fit compares it with what the fitted
constants charge those passes' exchanges (per exchange and per byte sent, as the replay does),
pooled over both directions and methods:

    transport_in_pass = sum over the passes of (process CPU - calling thread's CPU, per rank)
                        / sum over the passes of (the replay's transport seconds, per rank)

and the replay scales the transport's work by it (``FittedCompute.transport_in_pass``). Raw
samples from before (no ``process_s``), and GPUs, keep 1. The calling thread's own work outside
the kernel is left as fitted: in the same passes it took 1.1-1.25 times its fit, but with both
scaled the day's two Xeon sweeps came out over-predicted (the layouts' mean errors +1.2..+7.1%,
with the transport's alone -2.9..+2.2%, with neither -6.5..+1.7%; factors from the runs above).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from megatron_charm.plan import PlanOptions
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Exchange, Layout
from megatron_charm.sim.compute import FittedCompute
from megatron_charm.sim.engine import Engine
from megatron_charm.sim.programs import programs
from megatron_charm.sim.topology import Topology


def _pass_engine(
    compute: FittedCompute, method: str, layout: Layout, shape: AttnShape, backward: bool
) -> Engine:
    """An engine of one causal pass of ``method`` (default options), compiled, not run."""
    progs = programs(PlanOptions(method=method), layout, True, "full", shape)
    # links price neither blocks nor the transport's CPU; any will do
    topo = Topology(
        num_nodes=layout.num_nodes, ranks_per_node=layout.ranks_per_node, intra_bw=1.0, cross_bw=1.0
    )
    return Engine(progs, topo, shape, compute, backward)


def pass_block_seconds(
    compute: FittedCompute, method: str, layout: Layout, shape: AttnShape, backward: bool
) -> float:
    """Seconds the replay gives the blocks of one causal pass of ``method`` (default options)
    on ``layout`` with ``shape`` per rank, the mean over the ranks: their time alone where
    ``compute``'s own in-pass factors are 1."""
    eng = _pass_engine(compute, method, layout, shape, backward)
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
    pairs = _pairs(
        samples, lambda s: s["cpu_s"], pass_block_seconds, compute, layout, (batch, heads, head_dim)
    )
    factors, worst = [], 0.0
    for backward in (False, True):
        factor, miss = _pooled([(m, x) for b, m, x in pairs if b == backward])
        factors.append(factor)
        worst = max(worst, miss)
    return factors[0], factors[1], worst


def _pairs(
    samples: list[dict],
    measured: Callable[[dict], float | None],
    modelled: Callable[[FittedCompute, str, Layout, AttnShape, bool], float],
    compute: FittedCompute,
    layout: Layout,
    dims: tuple[int, int, int],
) -> list[tuple[bool, float, float]]:
    """``(backward, measured, modelled)`` of every sample whose ``measured(sample)`` is not
    ``None``, where both are > 0; ``modelled`` prices the sample's pass (``dims``: batch,
    heads, head dim)."""
    batch, heads, head_dim = dims
    out = []
    for s in samples:
        got = measured(s)
        if got is None:
            continue
        shape = AttnShape(batch, s["s_local"], heads, heads, head_dim)
        model = modelled(compute, s["method"], layout, shape, s["backward"])
        if model > 0 and got > 0:
            out.append((bool(s["backward"]), got, model))
    return out


def _pooled(got: list[tuple[float, float]]) -> tuple[float, float]:
    """``(sum measured / sum modelled, how far one pair's ratio lies from that, at most)`` of
    ``(measured, modelled)`` pairs; ``(1, 0)`` without pairs."""
    if not got:
        return 1.0, 0.0
    factor = sum(m for m, _ in got) / sum(x for _, x in got)
    return factor, max(abs(m / x / factor - 1.0) for m, x in got)


def pass_transport_seconds(
    compute: FittedCompute, method: str, layout: Layout, shape: AttnShape, backward: bool
) -> float:
    """CPU seconds the replay charges the transport's threads in one causal pass of ``method``
    (default options) on ``layout`` with ``shape`` per rank, the mean over the ranks: per
    exchange and per byte it sends (Note [Transport in a pass])."""
    eng = _pass_engine(compute, method, layout, shape, backward)
    per_rank = [
        sum(
            eng.exchange_transport_s(cost)
            for ins, cost in zip(instrs, costs, strict=True)
            if isinstance(ins, Exchange)
        )
        for instrs, costs in zip(eng.instrs, eng.costs, strict=True)
    ]
    return statistics.mean(per_rank)


def fit_transport_in_pass(
    samples: list[dict],
    compute: FittedCompute,
    layout: Layout,
    batch: int,
    heads: int,
    head_dim: int,
) -> tuple[float, float]:
    """``(factor, residual)`` of Note [Transport in a pass] from the ``process_s`` and
    ``thread_s`` of ``samples``
    (:func:`~megatron_charm.sim.calibrate_worker.time_blocks_in_passes`), against
    ``compute``'s transport constants as fitted (its own factor 1); ``residual``: how far one
    sample's ratio lies from the factor, at most. ``(1, 0)`` without such samples or without
    transport constants."""

    def transport(s: dict) -> float | None:  # the process's CPU less the calling thread's
        return s["process_s"] - s["thread_s"] if "process_s" in s and "thread_s" in s else None

    pairs = _pairs(
        samples, transport, pass_transport_seconds, compute, layout, (batch, heads, head_dim)
    )
    return _pooled([(m, x) for _, m, x in pairs])
