"""What each payload holds: tensor shapes and wire precisions (pure; no torch).

The executor allocates its receive buffers from :func:`payload_tensors`, and the byte accounting
and the simulator count bytes from it, so buffers and bytes cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_charm.plan.types import Chunk, Heads, Kind, Part, Payload, Wire


@dataclass(frozen=True)
class AttnShape:
    """The local problem of one CP rank."""

    b: int
    """Micro-batch size."""
    s_local: int
    """Tokens per rank (even under causal attention: two zigzag chunks)."""
    h: int
    """Query heads."""
    h_kv: int
    """Key/value heads (``h % h_kv == 0``)."""
    d: int
    """Head dim."""
    itemsize: int = 2
    """Bytes per element of the input dtype."""

    def __post_init__(self) -> None:
        # A zero size would surface far away, as a ZeroDivisionError inside the planner.
        sizes = {
            "b": self.b,
            "s_local": self.s_local,
            "h": self.h,
            "h_kv": self.h_kv,
            "d": self.d,
            "itemsize": self.itemsize,
        }
        bad = {k: v for k, v in sizes.items() if v < 1}
        if bad:
            raise ValueError(
                f"AttnShape({', '.join(f'{k}={v}' for k, v in bad.items())}): every size must "
                "be >= 1; check the batch size, local sequence length (tokens per CP rank), "
                "head counts and head dim"
            )
        if self.h % self.h_kv:
            raise ValueError(
                f"AttnShape(h={self.h}, h_kv={self.h_kv}): query heads must be a multiple of kv "
                "heads (h % h_kv == 0); change the query or kv head count"
            )

    def tokens(self, part: Part | Chunk) -> int:
        if type(part) is Chunk:
            return self.tokens(part.base) // part.count
        return self.s_local if part == Part.FULL else self.s_local // 2


Dims = tuple[int, ...]


def group_heads(shape: AttnShape, heads: Heads | None) -> tuple[int, int]:
    """Query and kv heads of the head group ``heads`` (``None``: all, ``(h, h_kv)``)."""
    if heads is None:
        return shape.h, shape.h_kv
    assert shape.h % heads.count == 0 and shape.h_kv % heads.count == 0, (shape, heads)
    return shape.h // heads.count, shape.h_kv // heads.count


def payload_tensors(
    kind: Kind, part: Part | Chunk, shape: AttnShape, wire: Wire, heads: Heads | None = None
) -> list[tuple[Dims, Wire]]:
    """``[(dims, precision)]`` of a payload's tensors, each ``[tokens, b, heads, d]`` (the lse:
    ``[tokens, b, h]``, always float32), with ``h / n`` and ``h_kv / n`` heads for a head group
    of ``n``. ``wire`` applies to partial results; inputs travel in the input dtype."""
    t = shape.tokens(part)
    h, h_kv = group_heads(shape, heads)
    q = (t, shape.b, h, shape.d)
    kv = (t, shape.b, h_kv, shape.d)
    lse = ((t, shape.b, h), Wire.FP32)
    if kind == Kind.Q:
        return [(q, Wire.INPUT)]
    if kind == Kind.KV:
        return [(kv, Wire.INPUT), (kv, Wire.INPUT)]
    if kind == Kind.QB:  # q, dout, lse, delta (Note [The backward bundle])
        return [(q, Wire.INPUT), (q, Wire.INPUT), lse, lse]
    if kind == Kind.DB:  # dout, lse, delta (Note [Keeping foreign queries])
        return [(q, Wire.INPUT), lse, lse]
    if kind == Kind.O:
        return [(q, wire), lse]
    if kind == Kind.DQ:
        return [(q, wire)]
    return [(kv, wire), (kv, wire)]  # Kind.DKV


def payload_bytes(payload: Payload, shape: AttnShape, wire: Wire) -> int:
    total = 0
    for dims, prec in payload_tensors(payload.kind, payload.part, shape, wire, payload.heads):
        numel = 1
        for x in dims:
            numel *= x
        total += numel * (shape.itemsize if prec == Wire.INPUT else 4)
    return total
