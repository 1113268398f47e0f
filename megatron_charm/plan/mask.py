"""Masks over packed sequences: which blocks a mask leaves empty, full or partial (pure).

Note [Masks and packed sequences]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A packed batch holds several documents; a token attends only to tokens of its own document, and
within it to a causal and/or sliding-window band. Every token is described by ``(doc, pos)``, its
document and its position in it, and a (q, kv) pair is allowed when::

    q.doc == kv.doc  and  lo <= kv.pos - q.pos <= hi

    causal:                 lo = -inf,   hi = 0
    window (left, right):   lo = -left,  hi = right      (causal and window: hi = min(right, 0))
    neither:                lo = -inf,   hi = +inf

Each half of a rank's local sequence (Note [Zigzag layout]) is a list of *runs*, stretches of
consecutive positions of one document. Two layouts produce them:

* ``thd`` (Transformer Engine's THD CP, Megatron's ``packed_seq_params``): every sequence is cut
  into ``2n`` chunks of its own, and rank ``r`` holds chunk ``r`` (its FIRST half) and chunk
  ``2n-1-r`` (its SECOND half) of *every* sequence::

      seqs  A (8 tokens), B (16 tokens), n = 2:   chunk of A = 2, chunk of B = 4
      rank 0 FIRST  = A[0:2] B[0:4]      rank 0 SECOND = A[6:8] B[12:16]
      rank 1 FIRST  = A[2:4] B[4:8]      rank 1 SECOND = A[4:6] B[8:12]

* ``bshd`` with document boundaries (``--reset-attention-mask``): the whole sample is zigzagged
  as one sequence, and a chunk holds pieces of whichever documents it overlaps.

A block (q half of x, kv half of y) is then one of::

    EMPTY    no allowed pair: no compute, no transfer, no merge
    FULL     one document, every pair allowed: the dense kernel, unmasked
    PARTIAL  a list of pieces (q run x kv run of one document, with its band lo..hi)

With ``bshd`` and documents no longer than a chunk, only diagonal blocks survive: nothing needs
to cross ranks. A plan that skips EMPTY blocks moves only what the mask needs; a ring moves every
kv regardless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from megatron_charm.plan.types import Part

INF = math.inf
HALVES = (Part.FIRST, Part.SECOND)


@dataclass(frozen=True)
class Run:
    """Consecutive positions ``[start, stop)`` of document ``doc``, stored at ``offset`` within
    the half of the local sequence that holds it."""

    doc: int
    start: int
    stop: int
    offset: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Band:
    """The allowed offsets ``lo <= kv.pos - q.pos <= hi`` within a document."""

    lo: float = -INF
    hi: float = INF

    @classmethod
    def of(cls, causal: bool, window: tuple[int, int] | None = None) -> Band:
        """The band of a causal and/or ``window=(left, right)`` mask; ``-1`` is unbounded, as in
        flash-attn's ``window_size``."""
        lo, hi = -INF, (0 if causal else INF)
        if window is not None:
            left, right = window
            if left < -1 or right < -1:
                raise ValueError(
                    f"window={window}: sizes must be >= 0, or -1 for unbounded; change the "
                    "attention window"
                )
            lo = -INF if left == -1 else -left
            hi = hi if right == -1 else min(hi, right)
        return cls(lo, hi)


class BlockKind(str, Enum):
    EMPTY = "empty"
    FULL = "full"
    PARTIAL = "partial"


@dataclass(frozen=True)
class Piece:
    """One document's share of a block: q run x kv run, with the band's mask between them."""

    q: Run
    kv: Run
    full: bool
    """Every pair of the piece is allowed (no mask needed inside it)."""


@dataclass(frozen=True)
class BlockMask:
    kind: BlockKind
    pieces: tuple[Piece, ...] = ()


def _piece_state(q: Run, kv: Run, band: Band) -> tuple[bool, bool]:
    """``(any_allowed, all_allowed)`` for q positions x kv positions of one document."""
    d_min = kv.start - (q.stop - 1)  # smallest kv.pos - q.pos
    d_max = (kv.stop - 1) - q.start
    return d_max >= band.lo and d_min <= band.hi, d_min >= band.lo and d_max <= band.hi


def classify(q_runs: Sequence[Run], kv_runs: Sequence[Run], band: Band) -> BlockMask:
    """How ``band`` within documents masks the block of ``q_runs`` x ``kv_runs``."""
    by_doc: dict[int, list[Run]] = {}
    for kv in kv_runs:
        by_doc.setdefault(kv.doc, []).append(kv)
    pieces = []
    for q in q_runs:
        for kv in by_doc.get(q.doc, ()):
            some, every = _piece_state(q, kv, band)
            if some:
                pieces.append(Piece(q, kv, every))
    if not pieces:
        return BlockMask(BlockKind.EMPTY)
    if len(pieces) == 1 and len(q_runs) == 1 and len(kv_runs) == 1 and pieces[0].full:
        return BlockMask(BlockKind.FULL, tuple(pieces))
    return BlockMask(BlockKind.PARTIAL, tuple(pieces))


def runs_by_doc(runs: Sequence[Run]) -> dict[int, list[Run]]:
    """``runs`` grouped by document."""
    out: dict[int, list[Run]] = {}
    for run in runs:
        out.setdefault(run.doc, []).append(run)
    return out


def any_allowed(q_runs: Sequence[Run], kv_by_doc: dict[int, list[Run]], band: Band) -> bool:
    """Whether the block of ``q_runs`` x the kv runs (grouped by :func:`runs_by_doc`) holds an
    allowed pair: what :func:`classify` finds non-empty, without its pieces, stopping at the
    first."""
    return any(_piece_state(q, kv, band)[0] for q in q_runs for kv in kv_by_doc.get(q.doc, ()))


def _runs(spans: Sequence[tuple[int, int, int]]) -> tuple[Run, ...]:
    """``(doc, start, stop)`` spans, stored one after another."""
    out, offset = [], 0
    for doc, start, stop in spans:
        if stop > start:
            out.append(Run(doc, start, stop, offset))
            offset += stop - start
    return tuple(out)


def thd_runs(
    seq_lens: Sequence[int], cp_size: int, real_lens: Sequence[int] | None = None
) -> dict[tuple[int, Part], tuple[Run, ...]]:
    """Runs of every (cp_rank, half) under the ``thd`` layout; ``seq_lens``: the padded length of
    each sequence (``cu_seqlens_padded`` differences), each a multiple of ``2 * cp_size``.

    ``real_lens`` (``cu_seqlens`` differences, each at most its padded length): the tokens past a
    sequence's real length are padding. They form a document of their own (id ``len(seq_lens) +
    i`` for sequence ``i``), so that no real token attends to padding and every padding token
    still attends to something (its outputs are finite; a loss mask drops them)."""
    real = list(seq_lens) if real_lens is None else list(real_lens)
    if len(real) != len(seq_lens):
        raise ValueError(
            f"{len(real)} real lengths for {len(seq_lens)} padded sequences; cu_seqlens and "
            "cu_seqlens_padded must describe the same sequences"
        )
    for i, length in enumerate(seq_lens):
        if length < 0 or length % (2 * cp_size) != 0:
            raise ValueError(
                f"sequence {i} has padded length {length}, which is not a multiple of 2 * cp_size "
                f"= {2 * cp_size}: THD context parallelism cuts every sequence into 2 * cp_size "
                "chunks; pad each sequence to a multiple (cu_seqlens_padded)"
            )
        if not 0 <= real[i] <= length:
            raise ValueError(
                f"sequence {i} has real length {real[i]} and padded length {length}: the real "
                "length must lie in [0, padded length]; check cu_seqlens against cu_seqlens_padded"
            )
    pad_id = len(seq_lens)
    out = {}
    for r in range(cp_size):
        for part, chunk in ((Part.FIRST, r), (Part.SECOND, 2 * cp_size - 1 - r)):
            spans = []
            for doc, length in enumerate(seq_lens):
                c = length // (2 * cp_size)
                lo, hi, cut = chunk * c, (chunk + 1) * c, real[doc]
                spans.append((doc, lo, min(hi, cut)))
                spans.append((pad_id + doc, max(lo, cut) - cut, hi - cut))
            out[(r, part)] = _runs(spans)
    return out


def bshd_doc_runs(doc_lens: Sequence[int], cp_size: int) -> dict[tuple[int, Part], tuple[Run, ...]]:
    """Runs of every (cp_rank, half) when one zigzagged sample holds documents of ``doc_lens``
    tokens back to back (their sum is the sample length, a multiple of ``2 * cp_size``)."""
    total = sum(doc_lens)
    if min(doc_lens, default=0) < 1 or total % (2 * cp_size) != 0:
        raise ValueError(
            f"documents of lengths {list(doc_lens)} (sum {total}) cannot fill a sample for "
            f"cp_size {cp_size}: lengths must be positive and sum to a multiple of "
            f"2 * cp_size = {2 * cp_size}; change the packing or the context-parallel size"
        )
    starts = [0]
    for length in doc_lens:
        starts.append(starts[-1] + length)
    chunk = total // (2 * cp_size)
    out = {}
    for r in range(cp_size):
        for part, c in ((Part.FIRST, r), (Part.SECOND, 2 * cp_size - 1 - r)):
            lo, hi = c * chunk, (c + 1) * chunk
            spans = [
                (d, max(lo, starts[d]) - starts[d], min(hi, starts[d + 1]) - starts[d])
                for d in range(len(doc_lens))
                if starts[d] < hi and starts[d + 1] > lo
            ]
            out[(r, part)] = _runs(spans)
    return out


BlockKey = tuple[int, Part, int, Part]
"""(q cp_rank, q half, kv cp_rank, kv half)."""


def block_masks(
    runs: dict[tuple[int, Part], tuple[Run, ...]], cp_size: int, band: Band
) -> dict[BlockKey, BlockMask]:
    """Every half-by-half block of the CP group, classified."""
    return {
        (x, qp, y, kp): classify(runs[(x, qp)], runs[(y, kp)], band)
        for x in range(cp_size)
        for qp in HALVES
        for y in range(cp_size)
        for kp in HALVES
    }


def nonempty_pattern(masks: dict[BlockKey, BlockMask]) -> frozenset[BlockKey]:
    """The blocks a plan must compute: the key of a plan cache (data-dependent masks that empty
    the same blocks share a plan, whatever their pieces)."""
    return frozenset(k for k, m in masks.items() if m.kind != BlockKind.EMPTY)


def thd_halves_order(seq_lens: Sequence[int], cp_size: int) -> list[int]:
    """Local token indices in halves order (every FIRST chunk, then every SECOND chunk).

    Transformer Engine's THD partition (``thd_get_partitioned_indices``, which Megatron's
    ``get_batch_on_this_cp_rank`` uses) stores a rank's tokens per sequence, ``[chunk r, chunk
    2n-1-r]`` for each sequence in turn; the runs of :func:`thd_runs` are in halves order, so
    ``local[thd_halves_order(...)]`` maps one to the other (the same on every rank).
    """
    firsts, seconds, offset = [], [], 0
    for length in seq_lens:
        c = length // (2 * cp_size)
        firsts.extend(range(offset, offset + c))
        seconds.extend(range(offset + c, offset + 2 * c))
        offset += 2 * c
    return firsts + seconds
