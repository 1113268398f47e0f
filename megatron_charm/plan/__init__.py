"""Pure planning: layouts, partner lists and per-rank programs for every method (no torch).

``build_plan(options, layout, causal)`` is the one entry point: the executor runs its programs,
:mod:`megatron_charm.plan.validate` replays them symbolically and the simulator replays them on a
cost model.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from megatron_charm.plan.layout import block_parts, zigzag_positions
from megatron_charm.plan.options import METHODS, PlanOptions, check_method
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.pipeline import PipelineConfig, pipeline_program
from megatron_charm.plan.ring import ring_backward, ring_forward
from megatron_charm.plan.types import Exchange, Layout, Part, Plan, Program
from megatron_charm.plan.wire import assign_wires

CHANNELS = {
    "full.kv": "full",
    "full.q": "full",
    "full.o": "full",
    "intra.kv": "intra",
    "intra.q": "intra",
    "intra.o": "intra",
    "cross.q": "cross",
    "cross.o": "cross",
}

# Channels whose node-merged partials may travel in the input dtype (cross_return="input").
CROSS_RETURN_CHANNELS = frozenset({"cross.o"})


def schedule_layout(method: str, layout: Layout) -> Layout:
    """The layout a method schedules on: only charm sees nodes; the others treat the CP group as
    one flat group (their node placement matters for cost, not for the schedule)."""
    return layout if method == "charm" else Layout(1, layout.cp_size)


def _check_layout(options: PlanOptions, layout: Layout) -> None:
    if options.combine_two_nodes and options.method == "charm" and layout.num_nodes > 2:
        raise ValueError(
            f"combine_two_nodes=True runs the paper's two-node pipeline, but the CP group has "
            f"{layout.num_nodes} nodes; set combine_two_nodes=False"
        )


def rank_programs(
    options: PlanOptions, layout: Layout, causal: bool, cp_ranks: Iterable[int]
) -> tuple[list[Program], list[Program]]:
    """Forward and backward programs of ``cp_ranks`` only (a simulator may replay one node),
    without wire precisions (see :func:`build_plan`)."""
    _check_layout(options, layout)
    method, n, ranks = options.method, layout.cp_size, list(cp_ranks)
    if method == "ring":
        return [ring_forward(r, n, causal) for r in ranks], [
            ring_backward(r, n, causal) for r in ranks
        ]
    if method == "charm":
        cfg = PipelineConfig(
            split=True,
            scope="intra",
            window=options.window,
            combine_two_nodes=options.combine_two_nodes,
        )
    else:
        cfg = PipelineConfig(split=method == "rm+", scope="full", window=options.window)
    flat = schedule_layout(method, layout)
    return [pipeline_program(r, flat, causal, cfg, backward=False) for r in ranks], [
        pipeline_program(r, flat, causal, cfg, backward=True) for r in ranks
    ]


def compact_channels(options: PlanOptions) -> frozenset[str]:
    """Channels whose merged partials travel in the input dtype under ``options``."""
    return CROSS_RETURN_CHANNELS if options.cross_return == "input" else frozenset()


@lru_cache(maxsize=256)
def build_plan(options: PlanOptions, layout: Layout, causal: bool) -> Plan:
    """Forward and backward programs of all ranks of a CP group with ``layout``, with the wire
    precision of every op decided (Note [Wire precision] in :mod:`megatron_charm.plan.wire`).

    Cached; the returned plan is immutable, so callers share it safely.
    """
    fwd, bwd = rank_programs(options, layout, causal, range(layout.cp_size))
    compact = compact_channels(options)
    fwd_t, bwd_t = assign_wires(fwd, False, compact), assign_wires(bwd, True, compact)
    used = sorted({i.channel for p in fwd_t + bwd_t for i in p.instrs if isinstance(i, Exchange)})
    return Plan(options, layout, causal, fwd_t, bwd_t, tuple((c, CHANNELS[c]) for c in used))


__all__ = [
    "METHODS",
    "CHANNELS",
    "AttnShape",
    "Layout",
    "Part",
    "Plan",
    "PlanOptions",
    "block_parts",
    "build_plan",
    "check_method",
    "rank_programs",
    "schedule_layout",
    "zigzag_positions",
]
