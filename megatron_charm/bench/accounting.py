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
from megatron_charm.plan.validate import Report, validate


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one pass moves: totals per class over all ranks, and the busiest cross link."""

    intra: int
    cross: int
    max_cross_link: int  # bytes on the busiest directed cross-node link

    def as_dict(self) -> dict[str, int]:
        return {"intra": self.intra, "cross": self.cross, "max_cross_link": self.max_cross_link}


def classify(report: Report, shape: AttnShape, layout: Layout, topology: str) -> LinkBytes:
    """Sum a validator report's sends per link class (see the module docstring)."""
    if topology not in ("shared", "rails"):
        raise ValueError(f"topology {topology!r}: expected 'shared' or 'rails'")
    intra = cross = 0
    links: dict[tuple[int, int, int], int] = defaultdict(int)
    for rec in report.sends:
        nbytes = payload_bytes(rec.payload, shape, rec.wire)
        src, dst = layout.node(rec.cp_rank), layout.node(rec.peer)
        if src == dst:
            intra += nbytes
            continue
        cross += nbytes
        rail = layout.local(rec.peer) if topology == "rails" else 0
        links[(src, dst, rail)] += nbytes
    return LinkBytes(intra, cross, max(links.values(), default=0))


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
    options = (options or PlanOptions()).replace(method=method)
    if mask is None:
        plan = build_plan(options, layout, causal, shape)
    else:
        model = mask.model(layout.cp_size, causal)
        dense = model.dense_causal
        cross, intra = plan_levels(options, layout, dense, shape)
        plan = plan_with_levels(options, layout, dense, cross, model.pattern, intra)
    fwd, bwd = validate(plan)
    return {
        "fwd": classify(fwd, shape, layout, topology),
        "bwd": classify(bwd, shape, layout, topology),
    }


def zigzag_ring_bytes(layout: Layout, shape: AttnShape, topology: str) -> dict[str, LinkBytes]:
    """ring-flash-attention's zigzag ring: every rank sends its full kv to the next rank ``n-1``
    times forward; backward the same kv plus float32 dk, dv ``n`` times (read from its source;
    it does not send halves)."""
    n = layout.cp_size
    kv = 2 * shape.s_local * shape.b * shape.h_kv * shape.d * shape.itemsize
    dkv32 = 2 * shape.s_local * shape.b * shape.h_kv * shape.d * 4
    out = {}
    for name, per_hop in (("fwd", kv * (n - 1)), ("bwd", kv * (n - 1) + dkv32 * n)):
        intra = cross = 0
        links: dict[tuple[int, int, int], int] = defaultdict(int)
        for r in range(n):
            peer = (r + 1) % n
            src, dst = layout.node(r), layout.node(peer)
            if src == dst:
                intra += per_hop
            else:
                cross += per_hop
                rail = layout.local(peer) if topology == "rails" else 0
                links[(src, dst, rail)] += per_hop
        out[name] = LinkBytes(intra, cross, max(links.values(), default=0))
    return out


def lower_bound_s(compute_s: float, max_cross_link_bytes: int, cross_bps: float) -> float:
    """``max(pure compute time, busiest cross link's bytes / its bandwidth)`` in seconds."""
    if cross_bps <= 0:
        return compute_s
    return max(compute_s, max_cross_link_bytes * 8 / cross_bps)
