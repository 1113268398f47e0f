"""Bytes per link class and the lower bound, from the plans (pure; no torch).

Every send of a plan is classified by where its peer lives in the real node layout (``m x p``),
whatever channel carries it: ``ring``, ``merge`` and ``rm+`` run on the flat CP group, so some of
their "full" channel traffic crosses nodes. Cross-node traffic is further split per directed
physical link of the testbed topology:

* ``shared``: one link per node pair; all ranks of a node share it;
* ``rails``: one link per node pair and local index; traffic travels on the destination's rail.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megatron_charm.plan import Layout, PlanOptions, build_plan, plan_levels, plan_with_levels
from megatron_charm.plan.docmask import DocMask
from megatron_charm.plan.payloads import AttnShape, payload_bytes
from megatron_charm.plan.types import Kind, Plan
from megatron_charm.plan.validate import Report, validate
from megatron_charm.sim.compute import block_area


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one pass moves: totals per class over all ranks, and the busiest cross link."""

    intra: int
    cross: int
    max_cross_link: int  # bytes on the busiest directed cross-node link

    def as_dict(self) -> dict[str, int]:
        return {"intra": self.intra, "cross": self.cross, "max_cross_link": self.max_cross_link}


def _link(layout: Layout, src: int, dst: int, peer: int, topology: str) -> tuple[int, int, int]:
    """The directed physical link from node ``src`` to node ``dst`` that a send to CP rank
    ``peer`` takes (see the module docstring): ``(src, dst, rail)``, rail 0 when shared."""
    return (src, dst, layout.local(peer) if topology == "rails" else 0)


def classify(report: Report, shape: AttnShape, layout: Layout, topology: str) -> LinkBytes:
    """Sum a validator report's sends per link class (see the module docstring)."""
    if topology not in ("shared", "rails"):
        raise ValueError(
            f"topology {topology!r}: expected 'shared' (one cross link per node pair) or 'rails' "
            "(one per local index); pass --topology shared or rails"
        )
    intra = cross = 0
    links: dict[tuple[int, int, int], int] = defaultdict(int)
    for rec in report.sends:
        nbytes = payload_bytes(rec.payload, shape, rec.wire)
        src, dst = layout.node(rec.cp_rank), layout.node(rec.peer)
        if src == dst:
            intra += nbytes
            continue
        cross += nbytes
        links[_link(layout, src, dst, rec.peer, topology)] += nbytes
    return LinkBytes(intra, cross, max(links.values(), default=0))


def method_plan(
    method: str,
    layout: Layout,
    causal: bool,
    shape: AttnShape,
    options: PlanOptions | None = None,
    mask: DocMask | None = None,
) -> Plan:
    """The plan of ``method`` on ``layout`` with ``options`` (its method replaced), as
    ``cp_attention`` builds it (pruned to ``mask`` if given)."""
    options = (options or PlanOptions()).replace(method=method)
    if mask is None:
        return build_plan(options, layout, causal, shape)
    model = mask.model(layout.cp_size, causal)
    dense = model.dense_causal
    cross, intra = plan_levels(options, layout, dense, shape)
    return plan_with_levels(options, layout, dense, cross, model.pattern, intra)


def method_bytes(
    method: str,
    layout: Layout,
    causal: bool,
    shape: AttnShape,
    topology: str,
    options: PlanOptions | None = None,
    mask: DocMask | None = None,
) -> dict[str, LinkBytes]:
    """``{"fwd": LinkBytes, "bwd": LinkBytes}`` of ``method`` on ``layout`` with ``options``
    (its method replaced), as ``cp_attention`` plans it (pruned to ``mask`` if given)."""
    fwd, bwd = validate(method_plan(method, layout, causal, shape, options, mask))
    return {
        "fwd": classify(fwd, shape, layout, topology),
        "bwd": classify(bwd, shape, layout, topology),
    }


def _tally(
    layout: Layout, topology: str, transfers: list[tuple[int, int]], nbytes: int
) -> LinkBytes:
    """Link bytes of ``nbytes`` sent along each ``(cp_rank, peer)`` of ``transfers``."""
    intra = cross = 0
    links: dict[tuple[int, int, int], int] = defaultdict(int)
    for r, peer in transfers:
        src, dst = layout.node(r), layout.node(peer)
        if src == dst:
            intra += nbytes
        else:
            cross += nbytes
            links[_link(layout, src, dst, peer, topology)] += nbytes
    return LinkBytes(intra, cross, max(links.values(), default=0))


def zigzag_ring_bytes(layout: Layout, shape: AttnShape, topology: str) -> dict[str, LinkBytes]:
    """ring-flash-attention's zigzag ring: every rank sends its full kv to the next rank ``n-1``
    times forward; backward the same kv plus float32 dk, dv ``n`` times (read from its source;
    it does not send halves)."""
    n = layout.cp_size
    kv = 2 * shape.s_local * shape.b * shape.h_kv * shape.d * shape.itemsize
    dkv32 = 2 * shape.s_local * shape.b * shape.h_kv * shape.d * 4
    hops = [(r, (r + 1) % n) for r in range(n)]
    return {
        name: _tally(layout, topology, hops, per_hop)
        for name, per_hop in (("fwd", kv * (n - 1)), ("bwd", kv * (n - 1) + dkv32 * n))
    }


def llama3_bytes(layout: Layout, shape: AttnShape, topology: str) -> dict[str, LinkBytes]:
    """ring-flash-attention's Llama 3 variant, counted as direct transfers: the forward gathers
    every rank's whole kv on every rank; the backward gathers it again and reduce-scatters dk, dv
    in the input dtype (each rank gets its own rows from every other rank)."""
    n = layout.cp_size
    kv = 2 * shape.s_local * shape.b * shape.h_kv * shape.d * shape.itemsize
    pairs = [(r, peer) for r in range(n) for peer in range(n) if peer != r]
    return {
        name: _tally(layout, topology, pairs, per) for name, per in (("fwd", kv), ("bwd", 2 * kv))
    }


def lower_bound_s(compute_s: float, max_cross_link_bytes: int, cross_bps: float) -> float:
    """``max(pure compute time, busiest cross link's bytes / its bandwidth)`` in seconds."""
    if cross_bps <= 0:
        return compute_s
    return max(compute_s, max_cross_link_bytes * 8 / cross_bps)


_INPUTS = (Kind.Q, Kind.QB, Kind.KV)


def dependency_bound_s(
    plan: Plan,
    report: Report,
    backward: bool,
    shape: AttnShape,
    topology: str,
    compute_s: float,
    cross_bps: float,
) -> float:
    """Note [The dependency-aware bound]: a lower bound on one pass of ``plan``, in seconds;
    ``report`` is the validator's report of that pass (``validate(plan)[backward]``).

    The byte bound (:func:`lower_bound_s`) lets both directions of a cross link be busy from
    the first to the last microsecond. A result cannot leave before the input it answers
    arrived and was computed::

        node B ──q1──q2──q3──────────────▶ node A      inputs: I bytes on the link
        node B ◀──────────o1────o2────o3── node A      results: R bytes back
               |first q|c|    R / rate   |
               |      I / rate     |c|o3|

    So, with ``c`` the smallest block computed on a foreign input and ``rate`` the link's, the
    pass takes at least the largest of:

    * the slowest rank's pure compute time (``compute_s``);
    * every directed cross link's bytes / rate;
    * for a link ``A -> B`` that carries results owned by node ``B``: the smallest input piece
      that crossed from ``B`` to ``A`` / rate + ``c`` + those results / rate (first-piece
      latency);
    * for a link ``B -> A`` that carries inputs owned by node ``B`` whose owners get results
      back from ``A``: those inputs / rate + ``c`` + the smallest such result / rate (last-piece
      compute).

    Inputs are ``q``, ``kv`` and the backward query bundle; results are partial ``o``, ``dq``
    and ``dkv``. Every CHARM+ plan answers each input that crosses with a result that crosses
    back (or, for kv in the forward, returns nothing, and only the byte terms apply). The piece
    sizes are the plan's, so the bound is that of the plan's decomposition (halves today).
    ``c`` is ``compute_s`` scaled by the block's share of the busiest rank's blocks. Link
    latency and intra-node links are taken as free. ``cross_bps <= 0``: compute only.
    """
    if cross_bps <= 0:
        return compute_s
    layout = plan.layout
    programs = plan.programs(backward)
    areas = [sum(block_area(c, shape) for c in prog.computes()) for prog in programs]
    sec_per_area = compute_s / max(max(areas), 1e-30)
    foreign = [
        block_area(c, shape)
        for prog in programs
        for c in prog.computes()
        if layout.node(prog.cp_rank) not in (layout.node(c.q_owner), layout.node(c.kv_owner))
        or layout.node(c.q_owner) != layout.node(c.kv_owner)
    ]
    c_min = min(foreign, default=0.0) * sec_per_area
    byte_s = 8 / cross_bps
    links: dict[tuple[int, int, int], int] = defaultdict(int)
    results: dict[tuple[int, int, int], int] = defaultdict(int)
    inputs: dict[tuple[int, int, int], int] = defaultdict(int)
    first_in: dict[tuple[int, int], int] = {}  # (from node, to node) -> smallest input piece
    last_out: dict[tuple[int, int], int] = {}  # (from node, to node) -> smallest result piece
    answered: set[tuple[int, int]] = set()  # (owner, node that returns its results)
    own_inputs = []  # (owner, link, bytes) of inputs that leave their owner's node
    for rec in report.sends:
        src, dst = layout.node(rec.cp_rank), layout.node(rec.peer)
        if src == dst:
            continue
        nbytes = payload_bytes(rec.payload, shape, rec.wire)
        link = _link(layout, src, dst, rec.peer, topology)
        links[link] += nbytes
        owner, owner_node = rec.payload.owner, layout.node(rec.payload.owner)
        if rec.payload.kind.is_partial and owner_node == dst:
            results[link] += nbytes
            last_out[(src, dst)] = min(last_out.get((src, dst), nbytes), nbytes)
            answered.add((owner, src))
        elif rec.payload.kind in _INPUTS and owner_node == src:
            own_inputs.append((owner, link, nbytes))
    for owner, (src, dst, rail), nbytes in own_inputs:
        if (owner, dst) in answered:  # only inputs whose results come back form a chain
            inputs[(src, dst, rail)] += nbytes
            first_in[(src, dst)] = min(first_in.get((src, dst), nbytes), nbytes)
    terms = [compute_s, *(b * byte_s for b in links.values())]
    for (a, b, _), r in results.items():
        if (b, a) in first_in:
            terms.append(first_in[(b, a)] * byte_s + c_min + r * byte_s)
    for (b, a, _), i in inputs.items():
        terms.append(i * byte_s + c_min + last_out[(a, b)] * byte_s)
    return max(terms)
