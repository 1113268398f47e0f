"""Pure planning: layouts, partner lists and per-rank programs for every method (no torch).

``build_plan(options, layout, causal)`` is the one entry point: the executor runs its programs,
:mod:`megatron_charm.plan.validate` replays them symbolically and the simulator replays them on a
cost model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from functools import lru_cache

from megatron_charm.plan.a2a import a2a_backward, a2a_forward, check_heads
from megatron_charm.plan.a2a_charm import a2a_charm_backward, a2a_charm_forward
from megatron_charm.plan.allgather import allgather_backward, allgather_forward
from megatron_charm.plan.bulk import collector_paused
from megatron_charm.plan.cost import cross_link_bytes, intra_send_bytes
from megatron_charm.plan.hierarchical import hierarchical_backward, hierarchical_forward
from megatron_charm.plan.keep import keep_foreign_q
from megatron_charm.plan.layout import (
    block_parts,
    contiguous_positions,
    sequence_positions,
    zigzag_positions,
)
from megatron_charm.plan.memory import attention_memory, pass_memory, saved_bytes
from megatron_charm.plan.options import METHODS, PlanOptions, check_method
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.pipeline import PipelineConfig, pipeline_program
from megatron_charm.plan.prune import prune_programs
from megatron_charm.plan.ring import ring_backward, ring_forward
from megatron_charm.plan.tasp import check_tasp_shape, tasp_backward, tasp_forward
from megatron_charm.plan.types import Exchange, Layout, Part, Plan, Program
from megatron_charm.plan.wire import assign_wires, own_wires

CHANNELS = {
    "full.kv": "full",
    "full.q": "full",
    "full.o": "full",
    "intra.kv": "intra",
    "intra.q": "intra",
    "intra.o": "intra",
    "cross.q": "cross",
    "cross.kv": "cross",
    "cross.o": "cross",
}

NODE_METHODS = ("charm", "a2a+p2p", "a2a+charm")
"""Methods whose schedule depends on the node split."""

Q_CROSSING = ("charm", "a2a+charm")
"""Methods with CHARM+'s cross-node step, where queries cross nodes and their node-merged results
come back: those results may travel in the input dtype (``cross_return``), and the backward may
keep the forward's queries (Note [Keeping foreign queries] in :mod:`megatron_charm.plan.keep`)."""

# Channels whose node-merged partials may travel in the input dtype (cross_return="input").
CROSS_RETURN_CHANNELS = frozenset({"cross.o"})


def schedule_layout(method: str, layout: Layout) -> Layout:
    """The layout a method schedules on: only :data:`NODE_METHODS` see nodes; the others treat
    the CP group as one flat group (their node placement matters for cost, not for the
    schedule)."""
    return layout if method in NODE_METHODS else Layout(1, layout.cp_size)


def rank_programs(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cp_ranks: Iterable[int],
    cross: tuple[str, str] = ("q", "q"),
    intra: tuple[str, str] = ("split", "split"),
) -> tuple[list[Program], list[Program]]:
    """Forward and backward programs of ``cp_ranks`` only (a simulator may replay one node),
    without wire precisions (see :func:`build_plan`). ``cross``: what charm ships across nodes
    in the forward and the backward (``q`` or ``kv``, as :func:`cross_levels` resolves it);
    ``intra``: what its ranks exchange inside a node (``split`` or ``kv``,
    :func:`intra_levels`)."""
    method, n, ranks = options.method, layout.cp_size, list(cp_ranks)
    if method in ("ring", "ring-contig"):
        seq = options.seq_layout
        return [ring_forward(r, n, causal, seq) for r in ranks], [
            ring_backward(r, n, causal, seq) for r in ranks
        ]
    if method == "all_gather":
        return [allgather_forward(r, n, causal) for r in ranks], [
            allgather_backward(r, n, causal) for r in ranks
        ]
    if method == "a2a":
        return [a2a_forward(r, n, causal) for r in ranks], [
            a2a_backward(r, n, causal) for r in ranks
        ]
    if method == "tasp":
        return [tasp_forward(r, n, causal) for r in ranks], [
            tasp_backward(r, n, causal) for r in ranks
        ]
    if method == "a2a+p2p":
        return [hierarchical_forward(r, layout, causal) for r in ranks], [
            hierarchical_backward(r, layout, causal) for r in ranks
        ]
    if method == "a2a+charm":
        return [a2a_charm_forward(r, layout, causal) for r in ranks], [
            a2a_charm_backward(r, layout, causal) for r in ranks
        ]
    if method == "charm":
        cfg = PipelineConfig(
            split=True,
            scope="intra",
            window=options.window,
            combine_nodes=options.combine_nodes,
        )
        # "dout" (q kept from the forward) schedules like "q"; keep_foreign_q then trims the
        # bundles (Note [Keeping foreign queries])
        cfg_f, cfg_b = (
            replace(cfg, cross="q" if c == "dout" else c, split=i == "split")
            for c, i in zip(cross, intra, strict=True)
        )
    else:
        cfg_f = cfg_b = PipelineConfig(split=method == "rm+", scope="full", window=options.window)
    flat = schedule_layout(method, layout)
    return [pipeline_program(r, flat, causal, cfg_f, backward=False) for r in ranks], [
        pipeline_program(r, flat, causal, cfg_b, backward=True) for r in ranks
    ]


def check_shape(options: PlanOptions, layout: Layout, shape: AttnShape) -> None:
    """Refuse a problem that ``options.method`` cannot split over ``layout``: ``a2a`` needs the
    heads to divide by the CP size, ``a2a+p2p`` by the ranks per node
    (:func:`megatron_charm.plan.a2a.check_heads`); ``tasp`` needs the local sequence to divide
    into ``cp_size - 1`` chunks of each half (:func:`megatron_charm.plan.tasp.check_tasp_shape`)."""
    if options.method == "tasp":
        check_tasp_shape(shape.s_local, layout.cp_size)
    if options.method == "a2a":
        check_heads(shape.h, shape.h_kv, layout.cp_size)
    elif options.method in ("a2a+p2p", "a2a+charm"):
        check_heads(shape.h, shape.h_kv, layout.ranks_per_node, options.method, "ranks_per_node")


def methods_for(layout: Layout, shape: AttnShape) -> tuple[str, ...]:
    """Every method of :data:`METHODS` that can run ``shape`` on ``layout``."""
    fits = []
    for method in METHODS:
        try:
            check_shape(PlanOptions(method=method), layout, shape)
        except ValueError:
            continue
        fits.append(method)
    return tuple(fits)


def compact_channels(options: PlanOptions) -> frozenset[str]:
    """Channels whose merged partials travel in the input dtype under ``options``."""
    # only charm's cross.o carries node-merged results home; a2a+p2p's cross.o carries ring
    # partials that are merged again at every hop, which stay float32 like the ring's
    charm_input = options.method in Q_CROSSING and options.cross_return == "input"
    return CROSS_RETURN_CHANNELS if charm_input else frozenset()


def build_plan(
    options: PlanOptions, layout: Layout, causal: bool, shape: AttnShape | None = None
) -> Plan:
    """Forward and backward programs of all ranks of a CP group with ``layout``, with the wire
    precision of every op decided (Note [Wire precision] in :mod:`megatron_charm.plan.wire`).

    ``shape`` (heads, kv heads, head dim, input bytes) matters only to ``cross_level="auto"``
    (:func:`cross_levels`); ``None`` means multi-head attention. Cached; the returned plan is
    immutable, so callers share it safely.
    """
    cross, intra = plan_levels(options, layout, causal, shape)
    return plan_with_levels(options, layout, causal, cross, intra=intra)


@lru_cache(maxsize=64)
def _dense_programs(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cross: tuple[str, str],
    intra: tuple[str, str] = ("split", "split"),
) -> tuple[list[Program], list[Program]]:
    with collector_paused():
        return rank_programs(options, layout, causal, range(layout.cp_size), cross, intra)


@lru_cache(maxsize=256)
def plan_with_levels(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cross: tuple[str, str],
    pattern: frozenset[tuple[int, Part, int, Part]] | None = None,
    intra: tuple[str, str] = ("split", "split"),
) -> Plan:
    """:func:`build_plan` with the cross and intra levels already resolved (cached by them).

    ``pattern``: prune the dense plan to these non-empty half blocks of a mask (Note [Pruning
    to a mask] in :mod:`megatron_charm.plan.prune`); masks that empty the same blocks share a
    plan, whatever their documents."""
    if pattern is not None and options.method == "tasp":
        raise ValueError(
            "method tasp schedules dense causal or full attention only; a document mask (packed "
            "sequences) needs another method (method= / --methods / --cp-comm-type)"
        )
    fwd, bwd = _dense_programs(options, layout, causal, cross, intra)
    compact = compact_channels(options)
    with collector_paused():
        if pattern is not None:
            fwd, bwd = prune_programs(fwd, False, pattern), prune_programs(bwd, True, pattern)
            fwd_t, bwd_t = assign_wires(fwd, False, compact), assign_wires(bwd, True, compact)
        else:
            fwd_t = tuple(own_wires(prog, False, compact) for prog in fwd)
            bwd_t = tuple(own_wires(prog, True, compact) for prog in bwd)
        if cross[1] == "dout":
            bwd_t = tuple(keep_foreign_q(f, b, layout) for f, b in zip(fwd_t, bwd_t, strict=True))
    used = sorted({i.channel for p in fwd_t + bwd_t for i in p.instrs if isinstance(i, Exchange)})
    channels = tuple((c, CHANNELS[c]) for c in used)
    return Plan(
        options, layout, causal, fwd_t, bwd_t, channels, cross=cross, intra=intra, pattern=pattern
    )


@lru_cache(maxsize=64)
def rank_plan(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cross: tuple[str, str],
    cp_rank: int,
    intra: tuple[str, str] = ("split", "split"),
) -> tuple[Program, Program]:
    """Forward and backward program of ``cp_rank`` alone, with wire precisions (dense plans).

    Note [Planning one rank]
    ~~~~~~~~~~~~~~~~~~~~~~~~
    A rank runs only its own programs, and every generator builds one rank's program without
    building the others', so a rank's plan costs O(its instructions), linear in the CP size,
    where :func:`build_plan` costs O(cp_size^2)::

        charm, causal, p = 8          32       128      1024
        build_plan + full replay    0.5 s    11 s     (~100 s build alone)
        rank_plan + its own check   -        0.04 s   0.8 s
        (docs/results/plan-scale.md; one CPU core)

    The wire precision of a receive depends on what the sender holds, which each generator
    knows and puts on the op (``Op.held``, Note [Wire precision]). It equals the program that
    :func:`build_plan` gives the rank; the tests check this on every method and a grid of
    layouts. Plans pruned to a mask need every program (pruning is a fixpoint over all ranks)
    and go through :func:`plan_with_levels`.
    """
    (fwd,), (bwd,) = rank_programs(options, layout, causal, [cp_rank], cross, intra)
    compact = compact_channels(options)
    fwd, bwd = own_wires(fwd, False, compact), own_wires(bwd, True, compact)
    if cross[1] == "dout":
        bwd = keep_foreign_q(fwd, bwd, layout)
    return fwd, bwd


def cross_levels(
    options: PlanOptions, layout: Layout, causal: bool, shape: AttnShape | None = None
) -> tuple[str, str]:
    """What charm ships across nodes in the forward and in the backward.

    Note [Cross level]
    ~~~~~~~~~~~~~~~~~~
    Per rank and node pair, shipping q costs q out plus its results back (``2 x h`` heads, the
    results in float32 unless ``cross_return="input"``); shipping kv costs ``2 x h_kv`` heads
    once (and its dk/dv back in the backward). With GQA (``h / h_kv = g >= 2``) kv is the
    smaller side: it crosses once, to the rank with the same local index, which shares it with
    its node through the same RM+ pipeline that CHARM+ runs for foreign queries::

        cross "q":  node a --q--> node b --out/lse--> node a      (kv never crosses)
        cross "kv": node a --kv--> node b; node b computes its own q against it
                    (backward: dk/dv cross back; q never crosses)

    ``auto`` builds both and keeps, per pass, the one with fewer bytes on the busiest directed
    cross-node link, then fewer cross bytes in total; a tie keeps ``q`` (the paper's design,
    whose sends do not wait for the other node). Both never move more than ring attention.

    A backward after a ``q`` forward can keep the forward's queries (Note [Keeping foreign
    queries]), which the per-pass choice cannot see: :func:`plan_levels` also weighs ``q`` in
    both passes with the queries kept, and takes it when the two passes' busiest links carry
    fewer bytes together (then fewer in total) and ``foreign_q`` allows keeping. Non-causal
    MHA on 2 x 2 (s_local 2048, 8 x 64, bf16): kv forward and q backward put 8.0 + 12.25 MiB on
    the busiest links, q with kept queries 8.12 + 8.25.
    """
    if options.method != "charm" or layout.num_nodes == 1:
        return ("q", "q")
    if options.cross_level != "auto":
        return (options.cross_level, options.cross_level)
    unit = _unit_shape(shape)
    # Every node pair moves the same pieces per rank pair, whatever m and p (p >= 2 only makes
    # node-merged results float32), so two nodes of up to two ranks decide, cheaply at any scale.
    return _auto_levels(options, Layout(2, min(layout.ranks_per_node, 2)), causal, unit)


@lru_cache(maxsize=256)
def _auto_levels(
    options: PlanOptions, layout: Layout, causal: bool, shape: AttnShape
) -> tuple[str, str]:
    plans = {
        level: plan_with_levels(options, layout, causal, (level,) * 2) for level in ("q", "kv")
    }
    chosen = []
    for backward in (False, True):

        def cost(level: str, backward: bool = backward) -> tuple[int, int]:
            links = cross_link_bytes(plans[level].programs(backward), layout, shape)
            return max(links.values(), default=0), sum(links.values())

        chosen.append("kv" if cost("kv") < cost("q") else "q")
    return (chosen[0], chosen[1])


def plan_levels(
    options: PlanOptions, layout: Layout, causal: bool, shape: AttnShape | None = None
) -> tuple[tuple[str, str], tuple[str, str]]:
    """``(cross, intra)``: charm's resolved cross and intra levels for a call
    (:func:`cross_levels`, :func:`intra_levels`, then :func:`keeps_foreign_q`, which turns a
    backward ``q`` into ``dout``); every caller that plans resolves them here."""
    cross = cross_levels(options, layout, causal, shape)
    intra = intra_levels(options, layout, causal, cross, shape)
    if keeps_foreign_q(options, layout, causal, cross, intra, shape):
        return (cross[0], "dout"), intra
    if _kept_q_moves_less(options, layout, causal, cross, shape):
        q_intra = intra_levels(options, layout, causal, ("q", "q"), shape)
        if keeps_foreign_q(options, layout, causal, ("q", "q"), q_intra, shape):
            return ("q", "dout"), q_intra
    return cross, intra


def _kept_q_moves_less(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cross: tuple[str, str],
    shape: AttnShape | None,
) -> bool:
    """Note [Cross level], last paragraph: whether q in both passes, with the backward keeping
    the forward's queries, puts fewer bytes on the busiest cross links of the two passes
    together than the per-pass choice ``cross`` (``cross_level="auto"`` only)."""
    if (
        options.method != "charm"
        or layout.num_nodes == 1
        or options.cross_level != "auto"
        or options.foreign_q == "resend"
        or cross == ("q", "q")
    ):
        return False
    small, unit = Layout(2, min(layout.ranks_per_node, 2)), _unit_shape(shape)
    kept = _joint_cross_cost(options, small, causal, ("q", "dout"), unit)
    return kept < _joint_cross_cost(options, small, causal, cross, unit)


@lru_cache(maxsize=256)
def _joint_cross_cost(
    options: PlanOptions, layout: Layout, causal: bool, cross: tuple[str, str], shape: AttnShape
) -> tuple[int, int]:
    """(busiest directed cross link's bytes summed over both passes, all cross bytes)."""
    plan = plan_with_levels(options, layout, causal, cross)
    busiest = total = 0
    for backward in (False, True):
        links = cross_link_bytes(plan.programs(backward), layout, shape)
        busiest += max(links.values(), default=0)
        total += sum(links.values())
    return busiest, total


def keeps_foreign_q(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cross: tuple[str, str],
    intra: tuple[str, str],
    shape: AttnShape | None = None,
) -> bool:
    """Whether charm's backward keeps the queries that crossed nodes in the forward (backward
    cross level ``dout``: Note [Keeping foreign queries] in :mod:`megatron_charm.plan.keep`).

    Only where q crosses in both passes. ``foreign_q="auto"`` keeps unless keeping takes the
    attention memory (the largest of the first and the last node's ranks, at most four nodes)
    above both ``memory_budget`` times ring attention's and what resending holds: the kept
    queries are held from the forward to the backward, and save their bytes on the backward's
    cross links (with MHA: 2 x 2 causal, busiest cross link 10.75 -> 6.55 MB per backward at
    s_local 2048, 8 x 64 heads; the peak grows by at most one q piece).
    """
    if options.method not in Q_CROSSING or layout.num_nodes == 1 or cross != ("q", "q"):
        return False
    if options.foreign_q != "auto":
        return options.foreign_q == "keep"
    small = Layout(min(layout.num_nodes, 4), layout.ranks_per_node)
    unit = _unit_shape(shape)
    if options.method == "a2a+charm":  # its head groups split the heads over a node
        p = layout.ranks_per_node
        unit = replace(unit, h=unit.h * p, h_kv=unit.h_kv * p)
    return _auto_keep(options, small, causal, intra, unit)


@lru_cache(maxsize=256)
def _auto_keep(
    options: PlanOptions, layout: Layout, causal: bool, intra: tuple[str, str], shape: AttnShape
) -> bool:
    p, last = layout.ranks_per_node, layout.num_nodes - 1
    ranks = (*range(p), *range(last * p, (last + 1) * p))

    def peak(cross: tuple[str, str]) -> int:
        plans = (rank_plan(options, layout, causal, cross, x, intra) for x in ranks)
        return max(attention_memory(f, b, shape)["peak"] for f, b in plans)

    with collector_paused():
        keep = peak(("q", "dout"))
        budget = options.memory_budget * _ring_memory(layout, causal, shape)
        # the budget first: ring's memory replays one node once (and is cached), resending's
        # replays both nodes' ranks again
        return keep <= budget or keep <= peak(("q", "q"))


def _unit_shape(shape: AttnShape | None) -> AttnShape:
    shape = shape or AttnShape(b=1, s_local=2, h=1, h_kv=1, d=64)
    if shape.h % shape.h_kv != 0:
        raise ValueError(f"{shape}: query heads must be a multiple of kv heads")
    # Every payload is linear in b and s_local, and in h and h_kv together (q and out in h*d,
    # kv in h_kv*d, the lse in h): a unit batch and length and the reduced head ratio decide.
    g = math.gcd(shape.h, shape.h_kv)
    return AttnShape(1, 2, shape.h // g, shape.h_kv // g, shape.d, shape.itemsize)


def intra_levels(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cross: tuple[str, str],
    shape: AttnShape | None = None,
) -> tuple[str, str]:
    """What charm's ranks exchange inside a node in the forward and in the backward.

    Note [Intra level]
    ~~~~~~~~~~~~~~~~~~
    RM+ (``split``, the paper's Algorithm 1) swaps kv with some partners and queries with the
    others, on two channels; a query exchange also returns the partner's results, and in the
    backward the query travels as a bundle (q, dout, lse, delta). The merge mechanism (``kv``)
    swaps kv with every partner and returns dk/dv. With multi-head attention the two are close;
    with GQA a kv pair is ``2 / g`` of a query, so kv exchanges move a fraction of the bytes
    and hold a fraction of the buffers (2 x 4 ranks, GQA 4:1: 84 against 146 MB inside the
    node forward, attention memory 27 against 41 MiB)::

        split:  x <-kv-> y   x <-q/bundle-> z, results back     (two channels)
        kv:     x <-kv-> y   x <-kv-> z, dk/dv back             (one channel)

    ``auto`` builds both for the first and the last node of the group (at most four nodes;
    every node runs the same pipeline, on loads that causal masking makes differ between nodes)
    and keeps, per pass, the one whose busiest rank sends fewer bytes to its node,
    then the one with the lower attention memory (:mod:`megatron_charm.plan.memory`); a tie
    keeps ``split``. Only levels whose attention memory stays within ``options.memory_budget``
    times ring attention's compete, unless none does. With at most two ranks per node both are
    the same schedule.
    """
    if options.method != "charm" or layout.ranks_per_node <= 2:
        return ("split", "split")
    if options.intra_level != "auto":
        return (options.intra_level, options.intra_level)
    small = Layout(min(layout.num_nodes, 4), layout.ranks_per_node)
    return _auto_intra(options, small, causal, cross, _unit_shape(shape))


@lru_cache(maxsize=256)
def _auto_intra(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cross: tuple[str, str],
    shape: AttnShape,
) -> tuple[str, str]:
    compact = compact_channels(options)
    # Under causal masking the nodes' loads differ: the first and the last node bracket them.
    p, last = layout.ranks_per_node, layout.num_nodes - 1
    ranks = [*range(p), *range(last * p, (last + 1) * p)] if last else range(p)
    saved = saved_bytes(shape)
    # (level, backward) -> (busiest rank's node-local bytes, the pass's share of the attention
    # memory: its peak, plus the saved out and lse in the backward)
    cost: dict[tuple[str, bool], tuple[int, int]] = {}
    with collector_paused():
        for level in ("split", "kv"):
            passes = rank_programs(options, layout, causal, ranks, cross, (level, level))
            for backward, progs in zip((False, True), passes, strict=True):
                wired = [own_wires(p, backward, compact) for p in progs]
                cost[(level, backward)] = (
                    max(intra_send_bytes(p, layout, shape) for p in wired),
                    max(pass_memory(p, shape, backward) for p in wired) + saved * backward,
                )
        budget = options.memory_budget * _ring_memory(layout, causal, shape)
    chosen = []
    for backward in (False, True):
        levels = ("split", "kv")  # min() keeps the first of equals: a tie keeps split
        fits = [lvl for lvl in levels if cost[(lvl, backward)][1] <= budget]
        chosen.append(min(fits or levels, key=lambda lvl: cost[(lvl, backward)]))
    return (chosen[0], chosen[1])


@lru_cache(maxsize=256)
def _ring_memory(layout: Layout, causal: bool, shape: AttnShape) -> int:
    """Ring attention's attention memory (pass peaks with the saved out and lse) on ``layout``'s
    node 0, the reference of ``PlanOptions.memory_budget``."""
    ring = PlanOptions(method="ring")
    fwd, bwd = rank_programs(ring, layout, causal, range(layout.ranks_per_node))
    compact = compact_channels(ring)
    peaks = [
        attention_memory(own_wires(f, False, compact), own_wires(b, True, compact), shape)["peak"]
        for f, b in zip(fwd, bwd, strict=True)
    ]
    return max(peaks)


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
    "contiguous_positions",
    "check_shape",
    "methods_for",
    "cross_levels",
    "intra_levels",
    "keeps_foreign_q",
    "plan_levels",
    "plan_with_levels",
    "rank_plan",
    "rank_programs",
    "schedule_layout",
    "sequence_positions",
    "zigzag_positions",
]
