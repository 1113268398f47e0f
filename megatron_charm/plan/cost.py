"""Bytes each rank sends per channel, from a plan (pure; no torch).

Every op carries its wire precision (decided by the planner, :mod:`megatron_charm.plan.wire`);
sizes come from :func:`megatron_charm.plan.payloads.payload_tensors`.
"""

from __future__ import annotations

from collections import defaultdict

from megatron_charm.plan.payloads import AttnShape, payload_bytes
from megatron_charm.plan.types import Exchange, Layout, Plan, Program


def program_bytes(prog: Program, shape: AttnShape) -> dict[str, int]:
    """``{channel: bytes}`` that one rank's program sends."""
    out: dict[str, int] = defaultdict(int)
    for ins in prog.instrs:
        if isinstance(ins, Exchange):
            for op in ins.ops:
                if op.send:
                    out[ins.channel] += payload_bytes(op.payload, shape, op.wire)
    return dict(out)


def cross_link_bytes(
    programs: tuple[Program, ...], layout: Layout, shape: AttnShape, rails: bool = False
) -> dict[tuple[int, ...], int]:
    """Bytes per directed cross-node link: ``(src node, dst node)``, or with ``rails`` (one link
    per local index, traffic on the destination's rail) ``(src node, dst node, rail)``."""
    out: dict[tuple[int, ...], int] = defaultdict(int)
    for prog in programs:
        src = layout.node(prog.cp_rank)
        for ins in prog.instrs:
            if not isinstance(ins, Exchange):
                continue
            for op in ins.ops:
                dst = layout.node(op.peer)
                if op.send and dst != src:
                    link = (src, dst, layout.local(op.peer)) if rails else (src, dst)
                    out[link] += payload_bytes(op.payload, shape, op.wire)
    return dict(out)


def intra_send_bytes(prog: Program, layout: Layout, shape: AttnShape) -> int:
    """Bytes that one rank's program sends to ranks of its own node."""
    node = layout.node(prog.cp_rank)
    return sum(
        payload_bytes(op.payload, shape, op.wire)
        for ins in prog.instrs
        if isinstance(ins, Exchange)
        for op in ins.ops
        if op.send and layout.node(op.peer) == node
    )


def plan_bytes(plan: Plan, shape: AttnShape) -> tuple[dict, dict]:
    """Forward and backward ``{cp_rank: {channel: bytes}}`` of a plan."""
    return tuple(  # type: ignore[return-value]
        {p.cp_rank: program_bytes(p, shape) for p in plan.programs(bwd)} for bwd in (False, True)
    )
