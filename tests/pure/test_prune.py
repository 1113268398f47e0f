"""Plans pruned to a document mask (Note [Pruning to a mask]): valid for every method, identical
to the dense plan when nothing is empty, and moving only what the mask needs."""

from __future__ import annotations

import random

import pytest

from megatron_charm.plan import METHODS, Layout, PlanOptions, cross_levels, plan_with_levels
from megatron_charm.plan.cost import program_bytes
from megatron_charm.plan.docmask import DocMask, half_blocks
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Exchange, Kind, Part
from megatron_charm.plan.validate import validate

# tasp refuses masks (tests/pure/test_tasp.py)
ZIGZAG_METHODS = [m for m in METHODS if m not in ("ring-contig", "tasp")]
LAYOUTS = [(1, 2), (2, 2), (1, 4), (2, 4), (4, 2)]
SHAPE = AttnShape(b=1, s_local=16, h=8, h_kv=2, d=16)


def _plan(method: str, layout: Layout, mask: DocMask | None, causal: bool):
    opts = PlanOptions(method=method)
    if mask is None:
        return plan_with_levels(opts, layout, causal, cross_levels(opts, layout, causal))
    model = mask.model(layout.cp_size, causal)
    dense = model.dense_causal
    cross = cross_levels(opts, layout, dense)
    return plan_with_levels(opts, layout, dense, cross, model.pattern)


def _random_docs(rng: random.Random, total: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, total), rng.randint(1, 6)))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True))


def _bytes(plan, backward: bool) -> int:
    return sum(sum(program_bytes(p, SHAPE).values()) for p in plan.programs(backward))


@pytest.mark.parametrize("method", ZIGZAG_METHODS)
@pytest.mark.parametrize("m,p", LAYOUTS)
def test_pruned_plans_validate_and_move_no_more(method, m, p):
    layout = Layout(m, p)
    n = layout.cp_size
    split = {"a2a": n, "a2a+p2p": p, "a2a+charm": p}.get(method, 1)
    if SHAPE.h_kv % split:
        pytest.skip(f"{method} splits the {SHAPE.h_kv} kv heads {split} ways")
    rng = random.Random(f"{method}{m}{p}")
    for causal in (True, False):
        dense = _plan(method, layout, None, causal)
        for _ in range(3):
            window = rng.choice([None, (rng.randint(0, 20), -1 if causal else rng.randint(0, 4))])
            mask = DocMask(_random_docs(rng, SHAPE.s_local * n), window=window)
            plan = _plan(method, layout, mask, causal)
            validate(plan)  # every non-empty half block once, nothing else; cannot hang
            for backward in (False, True):
                assert _bytes(plan, backward) <= _bytes(dense, backward)


@pytest.mark.parametrize("method", ZIGZAG_METHODS)
def test_nothing_empty_prunes_nothing(method):
    """One document and no window: the causal plan's own blocks are all non-empty, so pruning
    keeps every compute. It keeps the programs too, except where a zigzag ring runs (ring, and
    a2a+p2p across nodes): the dense ring carries the first kv's second half through hops where
    only later ranks, which use the first half, see it, and pruning drops that half."""
    layout = Layout(2, 2)
    mask = DocMask((SHAPE.s_local * 4,))
    pruned, dense = _plan(method, layout, mask, True), _plan(method, layout, None, True)
    for backward in (False, True):
        got, want = pruned.programs(backward), dense.programs(backward)
        assert [p.computes() for p in got] == [p.computes() for p in want]
        if method in ("ring", "a2a+p2p"):  # a2a+p2p runs that ring across nodes
            assert _bytes(pruned, backward) < _bytes(dense, backward)
        else:
            assert got == want


@pytest.mark.parametrize(
    "method", [m for m in ZIGZAG_METHODS if m not in ("a2a", "a2a+p2p", "a2a+charm")]
)
def test_documents_inside_chunks_move_nothing(method):
    """Documents that each fit one zigzag chunk leave only diagonal blocks: no rank sends an
    input, and no partial leaves its owner, except on ring's backward, whose dk/dv accumulators
    ride the ring back to their owners whatever is added on the way."""
    layout = Layout(2, 2)
    chunk = SHAPE.s_local // 2
    mask = DocMask((chunk,) * 8)
    plan = _plan(method, layout, mask, True)
    for backward in (False, True):
        for prog in plan.programs(backward):
            assert {(c.q_owner, c.kv_owner) for c in prog.computes()} == {(prog.cp_rank,) * 2}
            kinds = {op.payload.kind for ex in prog.exchanges() for op in ex.ops}
            if method == "ring" and backward:
                assert kinds <= {Kind.DKV}, kinds
            else:
                assert not kinds, (method, backward, prog.cp_rank, kinds)


def _needed_kv_halves(mask: DocMask, n: int, causal: bool) -> dict[int, set[tuple[int, Part]]]:
    """Brute force on the gathered sequence: the kv halves of other ranks that each rank's
    queries attend to."""
    model = mask.model(n, causal)
    need: dict[int, set[tuple[int, Part]]] = {x: set() for x in range(n)}
    for x in range(n):
        for y in range(n):
            if x == y:
                continue
            for qh, kh in half_blocks(Part.FULL, Part.FULL):
                q_runs, kv_runs = model.runs[(x, qh)], model.runs[(y, kh)]
                band = model.band
                if any(
                    a.doc == b.doc
                    and any(
                        band.lo <= j - i <= band.hi
                        for i in range(a.start, a.stop)
                        for j in range(b.start, b.stop)
                    )
                    for a in q_runs
                    for b in kv_runs
                ):
                    need[x].add((y, kh))
    return need


@pytest.mark.parametrize("causal", [True, False])
def test_all_gather_moves_exactly_what_the_mask_needs(causal):
    """all_gather delivers kv straight to its users: the kv halves each rank receives are exactly
    the halves its queries attend to, by brute force over token pairs."""
    rng = random.Random(7)
    n = 4
    for _ in range(6):
        window = rng.choice([None, (rng.randint(0, 24), -1 if causal else rng.randint(0, 6))])
        mask = DocMask(_random_docs(rng, SHAPE.s_local * n), window=window)
        plan = _plan("all_gather", Layout(1, n), mask, causal)
        need = _needed_kv_halves(mask, n, causal)
        for prog in plan.forward:
            got: set[tuple[int, Part]] = set()
            for ex in prog.exchanges():
                assert isinstance(ex, Exchange)
                for op in ex.ops:
                    if not op.send and op.payload.kind == Kind.KV:
                        halves = (
                            (Part.FIRST, Part.SECOND)
                            if op.payload.part == Part.FULL
                            else (op.payload.part,)
                        )
                        got |= {(op.payload.owner, h) for h in halves}
            assert got == need[prog.cp_rank], (mask, prog.cp_rank)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_pattern_matches_the_block_classification(layout):
    """MaskModel.pattern (first allowed pair per block) agrees with classify's full pieces."""
    from megatron_charm.plan.mask import block_masks, nonempty_pattern

    rng = random.Random(3)
    for n in (2, 4):
        for causal in (True, False):
            for _ in range(4):
                if layout == "bshd":
                    mask = DocMask(_random_docs(rng, 16 * n))
                else:
                    padded = [2 * n * rng.randint(1, 3) for _ in range(3)]
                    real = tuple(rng.randint(1, p) for p in padded)
                    mask = DocMask(tuple(padded), "thd", real)
                window = rng.choice([None, (rng.randint(0, 9), -1 if causal else 3)])
                mask = DocMask(mask.seq_lens, mask.layout, mask.real_lens, window)
                model = mask.model(n, causal)
                want = nonempty_pattern(block_masks(model.runs, n, model.band))
                assert model.pattern == want
