"""Pure planning: layouts, partner lists and per-rank programs for every method (no torch)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from megatron_charm.plan.layout import block_parts, zigzag_positions
from megatron_charm.plan.pipeline import PipelineConfig, pipeline_program
from megatron_charm.plan.ring import ring_backward, ring_forward
from megatron_charm.plan.types import Layout, Part, Plan, Program

METHODS = ("charm", "rm+", "merge", "ring")

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


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(
            f"unknown CP attention method {method!r}; expected one of {', '.join(METHODS)} "
            "(set method= / --cp-comm-type accordingly)"
        )


def rank_programs(
    method: str,
    layout: Layout,
    causal: bool,
    cp_ranks: Iterable[int],
    window: int = 2,
    combine_two_nodes: bool = False,
) -> tuple[list[Program], list[Program]]:
    """Forward and backward programs of ``cp_ranks`` only (a simulator may replay one node).

    ``layout`` is the node structure of the CP group; only ``charm`` uses it, the other methods
    treat the CP group as one flat group. ``combine_two_nodes`` selects the paper's Algorithm 2 for
    two nodes (own and foreign q in one round) instead of split foreign rounds.
    """
    check_method(method)
    if window < 1:
        raise ValueError(f"prefetch window {window} must be >= 1")
    n, ranks = layout.cp_size, list(cp_ranks)
    if method == "ring":
        return [ring_forward(r, n, causal) for r in ranks], [
            ring_backward(r, n, causal) for r in ranks
        ]
    if method == "charm":
        cfg = PipelineConfig(
            split=True, scope="intra", window=window, combine_two_nodes=combine_two_nodes
        )
        lay = layout
    else:
        cfg = PipelineConfig(split=method == "rm+", scope="full", window=window)
        lay = Layout(1, n)
    return [pipeline_program(r, lay, causal, cfg, backward=False) for r in ranks], [
        pipeline_program(r, lay, causal, cfg, backward=True) for r in ranks
    ]


@lru_cache(maxsize=256)
def build_plan(
    method: str,
    layout: Layout,
    causal: bool,
    window: int = 2,
    combine_two_nodes: bool = False,
    compact_cross: bool = False,
) -> Plan:
    """Forward and backward programs of all ranks (see :func:`rank_programs`).

    Merged partial results travel in float32; ``compact_cross`` sends the ones that cross nodes
    (charm's returned outputs and dq) in the input dtype instead: half the bytes on the slow link,
    one more rounding.
    """
    fwd, bwd = rank_programs(
        method, layout, causal, range(layout.cp_size), window, combine_two_nodes
    )
    used = {e.channel for prog in fwd + bwd for e in prog.exchanges()}
    compact = frozenset({"cross.o"} if compact_cross else ())
    return Plan(method, layout, causal, fwd, bwd, {c: CHANNELS[c] for c in sorted(used)}, compact)


__all__ = [
    "METHODS",
    "CHANNELS",
    "Layout",
    "Part",
    "Plan",
    "block_parts",
    "build_plan",
    "rank_programs",
    "check_method",
    "zigzag_positions",
]
