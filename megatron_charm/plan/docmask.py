"""A document mask over a CP group's sequence, and the kernel's view of one block of it (pure).

:class:`DocMask` is what a caller passes to ``cp_attention(mask=...)``: document lengths, their
layout across the CP group and an optional sliding window. :class:`MaskModel` resolves it for one
CP size: the runs of every rank's halves (:mod:`megatron_charm.plan.mask`), the pattern of
non-empty half blocks that a plan is pruned to (:mod:`megatron_charm.plan.prune`), and, for one
``Compute``, the :class:`Span` list that the masked kernel runs
(:mod:`megatron_charm.kernels.masked`).

Note [Block spans]
~~~~~~~~~~~~~~~~~~
A ``Compute`` names a q part and a kv part (a half or the whole local sequence). Its tensors hold
the runs of those halves one after another (FIRST before SECOND), so every piece of every half
block becomes a rectangle of rows x columns of the block, a :class:`Span`::

    q part FULL = [FIRST runs | SECOND runs]        kv part FIRST = [FIRST runs]
    span: rows [q0, q1) x columns [k0, k1), mode full | causal | band

    full     every pair allowed: the dense kernel, unmasked
    causal   the same positions on both sides, causal band: the dense kernel, causal
    band     anything else: allowed iff lo <= shift + j - i <= hi (row i, column j of the span)

Under a causal mask, runs of one document in one layout are either disjoint or identical (both
layouts cut a document at the same chunk boundaries), so only sliding windows need ``band``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from megatron_charm.plan.mask import (
    HALVES,
    INF,
    Band,
    BlockKey,
    BlockKind,
    Run,
    any_allowed,
    bshd_doc_runs,
    classify,
    runs_by_doc,
    thd_halves_order,
    thd_runs,
)
from megatron_charm.plan.types import Part

MASK_LAYOUTS = ("bshd", "thd")


@dataclass(frozen=True)
class DocMask:
    """Documents packed into the global sequence of a CP group, with an optional sliding window.

    A token attends only to tokens of its own document, within the causal and/or window band
    (Note [Masks and packed sequences] in :mod:`megatron_charm.plan.mask`). Every sample of the
    batch has the same documents (pass ``b = 1`` per call, or ``thd``, for different ones).
    """

    seq_lens: tuple[int, ...]
    """Length of every document (``bshd``: summing to the global sequence length) or of every
    padded sequence (``thd``: ``cu_seqlens_padded`` differences, each a multiple of
    ``2 * cp_size``)."""
    layout: str = "bshd"
    """``bshd``: the whole sample is zigzagged as one sequence (``--reset-attention-mask``);
    ``thd``: every sequence is zigzagged on its own and each rank holds its chunks sequence by
    sequence, as Transformer Engine's THD context parallelism and Megatron's
    ``get_batch_on_this_cp_rank`` lay them out."""
    real_lens: tuple[int, ...] | None = None
    """``thd`` only: real length of every sequence (``cu_seqlens`` differences); the rest of each
    padded sequence is padding, which only attends to itself. ``None``: no padding."""
    window: tuple[int, int] | None = None
    """Sliding window ``(left, right)`` as flash-attn's ``window_size`` (``-1``: unbounded);
    combined with ``causal`` the right side is 0."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", tuple(int(x) for x in self.seq_lens))
        if self.real_lens is not None:
            object.__setattr__(self, "real_lens", tuple(int(x) for x in self.real_lens))
        if self.layout not in MASK_LAYOUTS:
            raise ValueError(
                f"DocMask layout {self.layout!r} is unknown; expected one of {MASK_LAYOUTS}"
            )
        if self.real_lens is not None and self.layout != "thd":
            raise ValueError(
                "DocMask.real_lens describes THD padding; with layout 'bshd' pass the documents "
                "as seq_lens and leave real_lens unset"
            )
        if not self.seq_lens:
            raise ValueError("DocMask.seq_lens is empty; pass at least one document length")
        if self.window is not None:
            Band.of(False, self.window)  # raises on a bad window

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens: Sequence[int],
        cu_seqlens_padded: Sequence[int] | None = None,
        window: tuple[int, int] | None = None,
    ) -> DocMask:
        """The ``thd`` mask of Megatron's ``PackedSeqParams`` (cumulative lengths, first 0)."""
        real = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
        if cu_seqlens_padded is None:
            return cls(tuple(real), "thd", None, window)
        padded = [b - a for a, b in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:], strict=True)]
        return cls(tuple(padded), "thd", tuple(real), window)

    @property
    def total(self) -> int:
        """Global sequence length the mask covers."""
        return sum(self.seq_lens)

    def fingerprint(self) -> str:
        """A short digest for the call agreement (Note [Call agreement])."""
        return hashlib.blake2b(repr(self).encode(), digest_size=8).hexdigest()

    def model(self, cp_size: int, causal: bool) -> MaskModel:
        """Resolve the mask for ``cp_size`` ranks (raises ``ValueError`` on lengths that do not fit
        the layout)."""
        return _model(self, cp_size, causal)


@dataclass(frozen=True)
class Span:
    """Rows ``[q0, q1)`` x columns ``[k0, k1)`` of a block (Note [Block spans])."""

    q0: int
    q1: int
    k0: int
    k1: int
    mode: str
    """``full``, ``causal`` or ``band``."""
    shift: int = 0
    """``kv.pos - q.pos`` of row 0, column 0 (``band`` only)."""
    lo: float = -INF
    hi: float = INF


@dataclass(frozen=True)
class MaskModel:
    """A :class:`DocMask` resolved for one CP size (pure; see the module docstring)."""

    mask: DocMask
    cp_size: int
    causal: bool
    runs: dict[tuple[int, Part], tuple[Run, ...]] = field(hash=False, compare=False)

    @cached_property
    def band(self) -> Band:
        return Band.of(self.causal, self.mask.window)

    @cached_property
    def pattern(self) -> frozenset[BlockKey]:
        """Every non-empty half block ``(q cp_rank, q half, kv cp_rank, kv half)``."""
        band, runs, n = self.band, self.runs, self.cp_size
        kv = {key: runs_by_doc(r) for key, r in runs.items()}
        return frozenset(
            (x, qp, y, kp)
            for x in range(n)
            for qp in HALVES
            for y in range(n)
            for kp in HALVES
            if any_allowed(runs[(x, qp)], kv[(y, kp)], band)
        )

    @property
    def dense_causal(self) -> bool:
        """Whether the dense plan to prune is the causal one: a band that never looks ahead
        (``hi <= 0``) empties every block that causal masking empties."""
        return self.band.hi <= 0

    def local_order(self, s_local: int) -> list[int] | None:
        """Local token indices in halves order when the caller's order differs (``thd``), else
        ``None``: ``local[order]`` is in the order the runs describe."""
        if self.mask.layout != "thd":
            return None
        return thd_halves_order(self.mask.seq_lens, self.cp_size)

    def part_runs(self, owner: int, part: Part, half: int) -> list[Run]:
        """Runs of ``owner``'s ``part`` with offsets inside a tensor of that part (``half``:
        tokens per half)."""
        if part != Part.FULL:
            return list(self.runs[(owner, part)])
        second = [
            Run(r.doc, r.start, r.stop, r.offset + half) for r in self.runs[(owner, Part.SECOND)]
        ]
        return [*self.runs[(owner, Part.FIRST)], *second]

    def spans(
        self, q_owner: int, q_part: Part, kv_owner: int, kv_part: Part, half: int
    ) -> tuple[Span, ...]:
        """The spans of one ``Compute`` (Note [Block spans]); empty when the mask empties it."""
        band = self.band
        mask = classify(
            self.part_runs(q_owner, q_part, half), self.part_runs(kv_owner, kv_part, half), band
        )
        if mask.kind == BlockKind.EMPTY:
            return ()
        out = []
        for p in mask.pieces:
            q0, k0 = p.q.offset, p.kv.offset
            q1, k1 = q0 + p.q.length, k0 + p.kv.length
            aligned = p.q.start == p.kv.start and p.q.length == p.kv.length
            # a window wider than the piece leaves it plain causal
            reach = band.lo <= -(p.q.length - 1)
            if p.full:
                out.append(Span(q0, q1, k0, k1, "full"))
            elif aligned and reach and band.hi == 0:
                out.append(Span(q0, q1, k0, k1, "causal"))
            else:
                shift = p.kv.start - p.q.start
                out.append(Span(q0, q1, k0, k1, "band", shift, band.lo, band.hi))
        return tuple(out)


@lru_cache(maxsize=64)
def _model(mask: DocMask, cp_size: int, causal: bool) -> MaskModel:
    if mask.layout == "thd":
        runs = thd_runs(mask.seq_lens, cp_size, mask.real_lens)
    else:
        runs = bshd_doc_runs(mask.seq_lens, cp_size)
    return MaskModel(mask, cp_size, causal, runs)


def half_blocks(q_part: Part, kv_part: Part) -> list[tuple[Part, Part]]:
    """The ``(q half, kv half)`` pairs a block of these parts covers."""
    qs = HALVES if q_part == Part.FULL else (q_part,)
    ks = HALVES if kv_part == Part.FULL else (kv_part,)
    return [(a, b) for a in qs for b in ks]


__all__ = ["DocMask", "MASK_LAYOUTS", "MaskModel", "Span", "half_blocks"]
