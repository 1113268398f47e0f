"""Sequence layouts across a CP group and the block rule that follows from each.

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

Note [Contiguous layout]
~~~~~~~~~~~~~~~~~~~~~~~~
The layout without load balancing (the original Ring-Attention's, the paper's "Ring-Attention"
baseline): the global sequence is cut into ``n`` equal chunks and CP rank ``r`` holds chunk
``r``. Under causal masking a block (q of rank x, kv of rank y) is then::

    y == x : whole q vs whole kv, causal on local positions          cost 1/2
    y <  x : whole q vs whole kv, unmasked (every kv token precedes)   cost 1
    y >  x : empty: no compute (every kv token follows every query)    cost 0

    n = 4        kv 0  kv 1  kv 2  kv 3      ## full unmasked, dd diagonal (causal), .. empty
    q rank 0      dd    ..    ..    ..
    q rank 1      ##    dd    ..    ..       rank x computes x + 1 blocks (x + 1/2 full ones):
    q rank 2      ##    ##    dd    ..       rank 0 one, the last rank all n. The last rank sets
    q rank 3      ##    ##    ##    dd       the pace, (2n - 1) / n ~ 2x the balanced time.

Non-causal attention is the same in both layouts (every block full and unmasked). Only the
methods of :data:`megatron_charm.plan.options.SEQ_LAYOUT_OF` schedule on this layout; the layout of
the data is the caller's, so a method tells which one it expects.
"""

from __future__ import annotations

from functools import lru_cache

from megatron_charm.plan.types import Chunk, Part

ZIGZAG = "zigzag"
CONTIGUOUS = "contiguous"
#: Every sequence layout a plan can be scheduled on.
SEQ_LAYOUTS = (ZIGZAG, CONTIGUOUS)


def _check_seq_layout(seq_layout: str, func: str) -> None:
    if seq_layout not in SEQ_LAYOUTS:
        raise ValueError(
            f"{func}(seq_layout={seq_layout!r}): unknown sequence layout; pass one of "
            f"{SEQ_LAYOUTS} (a method's layout is PlanOptions.seq_layout)"
        )


def _check_rank(cp_rank: int, cp_size: int, func: str) -> None:
    if cp_size < 1:
        raise ValueError(
            f"{func}(cp_size={cp_size}): the context-parallel size must be >= 1; pass the CP "
            "group's size"
        )
    if not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"{func}(cp_rank={cp_rank}, cp_size={cp_size}): cp_rank must satisfy "
            "0 <= cp_rank < cp_size; pass this rank's index in the CP group"
        )


def block_empty(q_owner: int, kv_owner: int, causal: bool, seq_layout: str = ZIGZAG) -> bool:
    """Whether the block (q of ``q_owner``, kv of ``kv_owner``) has no allowed pair: only
    causal blocks above the diagonal of the contiguous layout (Note [Contiguous layout])."""
    return causal and seq_layout == CONTIGUOUS and kv_owner > q_owner


@lru_cache(maxsize=1 << 16)
def block_parts(
    q_owner: int, kv_owner: int, causal: bool, seq_layout: str = ZIGZAG
) -> tuple[Part, Part, bool]:
    """Return ``(q_part, kv_part, masked)`` for the block (q of ``q_owner``, kv of ``kv_owner``)
    under ``seq_layout`` (``zigzag`` or ``contiguous``); an empty block (:func:`block_empty`)
    has no parts, and asking for them is a planner bug."""
    # Checked up front, not only where the layouts differ, so a typo fails on every mask
    # (lru_cache runs this once per distinct argument tuple).
    _check_seq_layout(seq_layout, "block_parts")
    if not causal:
        return Part.FULL, Part.FULL, False
    if q_owner == kv_owner:
        return Part.FULL, Part.FULL, True
    if seq_layout == CONTIGUOUS:
        if kv_owner > q_owner:
            raise AssertionError(f"block ({q_owner},{kv_owner}) is empty in the contiguous layout")
        return Part.FULL, Part.FULL, False
    if kv_owner < q_owner:
        return Part.FULL, Part.FIRST, False
    return Part.SECOND, Part.FULL, False


def block_cost(q_owner: int, kv_owner: int, causal: bool, seq_layout: str = ZIGZAG) -> float:
    """Cost of a block in units of one full unmasked ``s_local x s_local`` block."""
    if not causal:
        return 1.0
    if seq_layout == CONTIGUOUS:
        if block_empty(q_owner, kv_owner, causal, seq_layout):
            return 0.0
        return 0.5 if q_owner == kv_owner else 1.0
    return 0.5


def computed_blocks(cp_size: int, causal: bool, seq_layout: str = ZIGZAG) -> set[tuple[int, int]]:
    """``(q owner, kv owner)`` of every block that a plan must compute."""
    return {
        (x, y)
        for x in range(cp_size)
        for y in range(cp_size)
        if not block_empty(x, y, causal, seq_layout)
    }


def balanced(causal: bool, seq_layout: str = ZIGZAG) -> bool:
    """Whether every rank's blocks cost the same (all but the causal contiguous layout)."""
    return not causal or seq_layout != CONTIGUOUS


def zigzag_positions(cp_rank: int, cp_size: int, seq_len: int) -> list[int]:
    """Global token positions held by ``cp_rank`` in local order (``seq_len``: global length)."""
    _check_rank(cp_rank, cp_size, "zigzag_positions")
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


def contiguous_positions(cp_rank: int, cp_size: int, seq_len: int) -> list[int]:
    """Global token positions held by ``cp_rank`` in the contiguous layout (chunk ``cp_rank`` of
    ``cp_size``; ``seq_len``: global length)."""
    _check_rank(cp_rank, cp_size, "contiguous_positions")
    if seq_len % cp_size != 0:
        raise ValueError(
            f"global sequence length {seq_len} must be divisible by cp_size = {cp_size} for the "
            "contiguous layout; change the sequence length or the context-parallel size"
        )
    chunk = seq_len // cp_size
    return list(range(cp_rank * chunk, (cp_rank + 1) * chunk))


def sequence_positions(cp_rank: int, cp_size: int, seq_len: int, seq_layout: str) -> list[int]:
    """Global token positions held by ``cp_rank`` under ``seq_layout`` (``zigzag`` or
    ``contiguous``), in local order."""
    _check_seq_layout(seq_layout, "sequence_positions")
    if seq_layout == CONTIGUOUS:
        return contiguous_positions(cp_rank, cp_size, seq_len)
    return zigzag_positions(cp_rank, cp_size, seq_len)


def part_span(part: Part | Chunk, length: int) -> tuple[int, int]:
    """``[start, end)`` of ``part`` in a local sequence of ``length`` tokens (a chunk is an equal
    piece of its base part, which the caller's shape check makes divisible)."""
    if type(part) is Chunk:
        start, end = part_span(part.base, length)
        size = (end - start) // part.count
        assert size * part.count == end - start, (part, length)
        return start + part.index * size, start + (part.index + 1) * size
    half = length // 2
    if part == Part.FULL:
        return 0, length
    if part == Part.FIRST:
        return 0, half
    return half, length


def part_slice(part: Part | Chunk, length: int) -> slice:
    """Slice of a local sequence of ``length`` tokens covered by ``part``."""
    return slice(*part_span(part, length))


def sub_slice(outer: Part | Chunk, inner: Part | Chunk, length: int) -> slice:
    """Slice of ``inner`` inside a tensor that holds ``outer`` of a ``length``-token sequence."""
    if not outer.contains(inner):
        raise AssertionError(f"{inner} is not inside {outer}")
    if outer == inner:
        return slice(None)
    start = part_span(outer, length)[0]
    a, b = part_span(inner, length)
    return slice(a - start, b - start)
