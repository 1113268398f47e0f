"""The mask model over packed sequences, against brute force on the gathered sequence."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_charm.plan.mask import (
    HALVES,
    Band,
    BlockKind,
    block_masks,
    bshd_doc_runs,
    nonempty_pattern,
    thd_halves_order,
    thd_runs,
)
from megatron_charm.plan.types import Part


def _tokens(runs):
    """(doc, pos) of every token of a half, in storage order."""
    out = []
    for run in runs:
        assert run.offset == len(out)
        out.extend((run.doc, p) for p in range(run.start, run.stop))
    return out


def _allowed(q, k, band: Band) -> bool:
    return q[0] == k[0] and band.lo <= k[1] - q[1] <= band.hi


def _check_against_brute_force(runs, cp_size: int, band: Band) -> None:
    masks = block_masks(runs, cp_size, band)
    for (x, qp, y, kp), mask in masks.items():
        qs, ks = _tokens(runs[(x, qp)]), _tokens(runs[(y, kp)])
        truth = {(i, j) for i, a in enumerate(qs) for j, b in enumerate(ks) if _allowed(a, b, band)}
        covered = set()
        for piece in mask.pieces:
            for i in range(piece.q.offset, piece.q.offset + piece.q.length):
                for j in range(piece.kv.offset, piece.kv.offset + piece.kv.length):
                    ok = _allowed(qs[i], ks[j], band)
                    assert not piece.full or ok, "a piece marked full holds a masked pair"
                    if ok:
                        covered.add((i, j))
        assert covered == truth, (x, qp, y, kp)
        everything = len(truth) == len(qs) * len(ks)
        single = len(runs[(x, qp)]) == 1 and len(runs[(y, kp)]) == 1
        if not truth:
            assert mask.kind == BlockKind.EMPTY
        elif everything and single:
            assert mask.kind == BlockKind.FULL
        else:
            assert mask.kind == BlockKind.PARTIAL


BANDS = [Band.of(True), Band.of(False), Band.of(True, (5, 0)), Band.of(False, (3, 2))]


@pytest.mark.parametrize("band", BANDS, ids=["causal", "full", "causal-window", "window"])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_thd_against_brute_force(cp_size, band):
    rng = random.Random(cp_size)
    for _ in range(4):
        seq_lens = [2 * cp_size * rng.randint(0, 4) for _ in range(rng.randint(1, 4))]
        _check_against_brute_force(thd_runs(seq_lens, cp_size), cp_size, band)


@pytest.mark.parametrize("band", BANDS, ids=["causal", "full", "causal-window", "window"])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_packed_documents_against_brute_force(cp_size, band):
    rng = random.Random(10 + cp_size)
    for _ in range(4):
        total = 2 * cp_size * rng.randint(1, 5)
        cuts = sorted(rng.sample(range(1, total), k=min(total - 1, rng.randint(0, 4))))
        doc_lens = [b - a for a, b in itertools.pairwise([0, *cuts, total])]
        _check_against_brute_force(bshd_doc_runs(doc_lens, cp_size), cp_size, band)


def test_one_document_is_the_dense_zigzag_rule():
    """One causal document over the whole sample: the blocks the dense plans compute."""
    n = 4
    masks = block_masks(bshd_doc_runs([8 * n], n), n, Band.of(True))
    for (x, qp, y, kp), mask in masks.items():
        q_chunk = x if qp == Part.FIRST else 2 * n - 1 - x
        kv_chunk = y if kp == Part.FIRST else 2 * n - 1 - y
        expected = (
            BlockKind.EMPTY
            if kv_chunk > q_chunk
            else (BlockKind.PARTIAL if kv_chunk == q_chunk else BlockKind.FULL)
        )
        assert mask.kind == expected


def test_documents_no_longer_than_a_chunk_need_no_communication():
    """8 documents of 2K in a 16K sample on CP 4: only each rank's own blocks survive."""
    n = 4
    pattern = nonempty_pattern(block_masks(bshd_doc_runs([2048] * 8, n), n, Band.of(True)))
    assert pattern and all(x == y for x, _, y, _ in pattern)
    # Shift the documents by half a chunk: each now spans two neighbouring chunks (c, c+1), so
    # exactly the q of chunk c+1 meets the kv of chunk c; chunks 3 and 4 share rank 3.
    docs = [1024, *[2048] * 6, 3072]
    pattern = nonempty_pattern(block_masks(bshd_doc_runs(docs, n), n, Band.of(True)))
    owner = [0, 1, 2, 3, 3, 2, 1, 0]  # rank of each chunk
    expected = {(owner[c + 1], owner[c]) for c in range(7)} - {(3, 3)}
    assert {(x, y) for x, _, y, _ in pattern if x != y} == expected


def test_a_window_empties_distant_blocks():
    n, chunk = 4, 64
    masks = block_masks(bshd_doc_runs([2 * n * chunk], n), n, Band.of(True, (chunk // 2, 0)))
    for (x, qp, y, kp), mask in masks.items():
        q_chunk = x if qp == Part.FIRST else 2 * n - 1 - x
        kv_chunk = y if kp == Part.FIRST else 2 * n - 1 - y
        near = q_chunk - kv_chunk in (0, 1)
        assert (mask.kind != BlockKind.EMPTY) == near


def test_thd_halves_order_matches_te_partition():
    """TE stores [chunk r, chunk 2n-1-r] per sequence; the runs list FIRST chunks first."""
    seq_lens, n = [8, 16], 2
    for r in range(n):
        te_order = []  # (doc, pos) in TE's local order
        for doc, length in enumerate(seq_lens):
            c = length // (2 * n)
            for chunk in (r, 2 * n - 1 - r):
                te_order.extend((doc, p) for p in range(chunk * c, (chunk + 1) * c))
        runs = thd_runs(seq_lens, n)
        halves = _tokens(runs[(r, Part.FIRST)]) + _tokens(runs[(r, Part.SECOND)])
        assert [te_order[i] for i in thd_halves_order(seq_lens, n)] == halves


def test_bad_inputs_name_the_rule():
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size = 8"):
        thd_runs([8, 12], 4)
    with pytest.raises(ValueError, match="sum to a multiple"):
        bshd_doc_runs([3, 4], 2)
    with pytest.raises(ValueError, match="window=\\(-2, 0\\)"):
        Band.of(True, (-2, 0))
    assert Band.of(False, (-1, -1)) == Band(-math.inf, math.inf)
    assert HALVES == (Part.FIRST, Part.SECOND)
