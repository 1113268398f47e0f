"""Bytes each rank sends per channel, from a plan (pure; no torch).

Every op carries its wire precision (decided by the planner, :mod:`megatron_charm.plan.wire`);
sizes come from :func:`megatron_charm.plan.payloads.payload_tensors`.
"""

from __future__ import annotations

from collections import defaultdict

from megatron_charm.plan.payloads import AttnShape, payload_bytes
from megatron_charm.plan.types import Exchange, Plan, Program


def program_bytes(prog: Program, shape: AttnShape) -> dict[str, int]:
    """``{channel: bytes}`` that one rank's program sends."""
    out: dict[str, int] = defaultdict(int)
    for ins in prog.instrs:
        if isinstance(ins, Exchange):
            for op in ins.ops:
                if op.send:
                    out[ins.channel] += payload_bytes(op.payload, shape, op.wire)
    return dict(out)


def plan_bytes(plan: Plan, shape: AttnShape) -> tuple[dict, dict]:
    """Forward and backward ``{cp_rank: {channel: bytes}}`` of a plan."""
    return tuple(  # type: ignore[return-value]
        {p.cp_rank: program_bytes(p, shape) for p in plan.programs(bwd)} for bwd in (False, True)
    )
