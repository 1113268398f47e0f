"""Sizes of payloads and the bytes each rank sends per channel (pure; no torch).

Inputs (q, kv, the backward bundle) travel in the input dtype; the lse in float32. A partial result
that holds a single block travels as the kernel produced it (input dtype); a merged one in float32
(unless the plan is built with ``compact_cross``: then charm's cross-node returns use the input
dtype).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megatron_charm.plan.types import Kind, Part, Payload, Plan
from megatron_charm.plan.validate import Report, validate

INPUT, FP32 = "input", "fp32"


@dataclass(frozen=True)
class AttnShape:
    """Local problem: batch ``b``, ``s_local`` tokens per rank, heads, head dim, input bytes."""

    b: int
    s_local: int
    h: int
    h_kv: int
    d: int
    itemsize: int = 2

    def tokens(self, part: Part) -> int:
        return self.s_local if part == Part.FULL else self.s_local // 2


def payload_tensors(kind: Kind, tokens: int, shape: AttnShape, raw: bool):
    """``[(dims, precision)]`` of a payload's tensors; precision is ``"input"`` or ``"fp32"``."""
    q = (tokens, shape.b, shape.h, shape.d)
    kv = (tokens, shape.b, shape.h_kv, shape.d)
    lse = ((tokens, shape.b, shape.h), FP32)
    part_prec = INPUT if raw else FP32
    return {
        Kind.Q: [(q, INPUT)],
        Kind.KV: [(kv, INPUT), (kv, INPUT)],
        Kind.QB: [(q, INPUT), (q, INPUT), (q, INPUT), lse],
        Kind.O: [(q, part_prec), lse],
        Kind.DQ: [(q, part_prec)],
        Kind.DKV: [(kv, part_prec), (kv, part_prec)],
    }[kind]


def payload_bytes(payload: Payload, shape: AttnShape, raw: bool) -> int:
    total = 0
    for dims, prec in payload_tensors(payload.kind, shape.tokens(payload.part), shape, raw):
        numel = 1
        for x in dims:
            numel *= x
        total += numel * (shape.itemsize if prec == INPUT else 4)
    return total


def bytes_sent(report: Report, shape: AttnShape) -> dict[int, dict[str, int]]:
    """``{cp_rank: {channel: bytes}}`` for one pass, from a validator report."""
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for rec in report.sends:
        out[rec.cp_rank][rec.channel] += payload_bytes(rec.payload, shape, rec.raw)
    return {r: dict(ch) for r, ch in out.items()}


def plan_bytes(plan: Plan, shape: AttnShape) -> tuple[dict, dict]:
    """Forward and backward ``{cp_rank: {channel: bytes}}`` of a plan."""
    fwd, bwd = validate(plan)
    return bytes_sent(fwd, shape), bytes_sent(bwd, shape)
