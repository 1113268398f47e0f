"""The causal load-balanced ("zigzag") sequence layout and the block rule that follows from it.

Note [Zigzag layout]
~~~~~~~~~~~~~~~~~~~~
The global sequence is cut into ``2n`` equal chunks for a CP group of ``n`` ranks. CP rank ``r``
holds chunks ``r`` and ``2n-1-r``, concatenated::

    n = 4, chunks 0..7      rank 0: [0 | 7]   rank 1: [1 | 6]   rank 2: [2 | 5]   rank 3: [3 | 4]

For the block (q of rank x, kv of rank y) only part of the work is unmasked:

    y == x : whole q vs whole kv, causal on local positions (local order is position order)
    y <  x : whole q vs FIRST half of kv (chunk y precedes both q chunks; chunk 2n-1-y follows both)
    y >  x : SECOND half of q vs whole kv (only chunk 2n-1-x follows chunks y and 2n-1-y)

Every off-diagonal block is half a full block, and the diagonal costs the same, so every rank's
``n`` blocks cost the same. Only the half that a receiver uses has to travel.
"""

from __future__ import annotations

from megatron_charm.plan.types import Part


def block_parts(q_owner: int, kv_owner: int, causal: bool) -> tuple[Part, Part, bool]:
    """Return ``(q_part, kv_part, masked)`` for the block (q of ``q_owner``, kv of ``kv_owner``)."""
    if not causal:
        return Part.FULL, Part.FULL, False
    if q_owner == kv_owner:
        return Part.FULL, Part.FULL, True
    if kv_owner < q_owner:
        return Part.FULL, Part.FIRST, False
    return Part.SECOND, Part.FULL, False


def block_cost(q_owner: int, kv_owner: int, causal: bool) -> float:
    """Cost of a block in units of one full unmasked ``s_local x s_local`` block."""
    if not causal:
        return 1.0
    return 0.5


def zigzag_positions(cp_rank: int, cp_size: int, seq_len: int) -> list[int]:
    """Global token positions held by ``cp_rank`` in local order (``seq_len``: global length)."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"global sequence length {seq_len} must be divisible by 2 * cp_size = {2 * cp_size} "
            "for the zigzag layout; change the sequence length or the context-parallel size"
        )
    chunk = seq_len // (2 * cp_size)
    first = range(cp_rank * chunk, (cp_rank + 1) * chunk)
    last = 2 * cp_size - 1 - cp_rank
    second = range(last * chunk, (last + 1) * chunk)
    return [*first, *second]


def part_slice(part: Part, length: int) -> slice:
    """Slice of a local sequence of ``length`` tokens covered by ``part``."""
    half = length // 2
    if part == Part.FULL:
        return slice(0, length)
    if part == Part.FIRST:
        return slice(0, half)
    return slice(half, length)


def sub_slice(outer: Part, inner: Part, length: int) -> slice:
    """Slice of ``inner`` inside a tensor that holds ``outer`` of a ``length``-token sequence."""
    if not outer.contains(inner):
        raise AssertionError(f"{inner} is not inside {outer}")
    if outer == inner:
        return slice(None)
    return part_slice(inner, length)
