"""TASP on the planner (Note [TASP schedule]): chunks, the link pattern, bytes and refusals."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_charm.plan import (
    AttnShape,
    Layout,
    PlanOptions,
    build_plan,
    check_shape,
    compact_channels,
)
from megatron_charm.plan.check_rank import check_rank_program
from megatron_charm.plan.cost import plan_bytes
from megatron_charm.plan.docmask import DocMask
from megatron_charm.plan.layout import part_span, sub_slice
from megatron_charm.plan.types import Chunk, Exchange, Kind, Merge, Part, Program
from megatron_charm.plan.validate import ScheduleError, validate


def test_chunk_spans_tile_their_part():
    for base, (start, end) in ((Part.FULL, (0, 12)), (Part.FIRST, (0, 6)), (Part.SECOND, (6, 12))):
        spans = [part_span(Chunk(base, i, 3), 12) for i in range(3)]
        assert spans[0][0] == start and spans[-1][1] == end
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert {b - a for a, b in spans} == {(end - start) // 3}


def test_chunk_containment_and_union():
    c = Chunk(Part.FIRST, 1, 3)
    assert Part.FULL.contains(c) and Part.FIRST.contains(c)
    assert not Part.SECOND.contains(c) and not c.contains(Part.FIRST)
    assert c.contains(c) and not c.contains(Chunk(Part.FIRST, 0, 3))
    assert Part.FIRST.union(c) is Part.FIRST and c.union(Part.FIRST) is Part.FIRST
    assert c.union(Chunk(Part.FIRST, 2, 3)) is Part.FIRST  # wider than the two: their base
    assert c.union(Part.SECOND) is Part.FULL and Part.SECOND.union(c) is Part.FULL
    # a chunk of the first half inside a tensor that holds the whole sequence, or that half
    assert sub_slice(Part.FULL, c, 12) == slice(2, 4)
    assert sub_slice(Part.FIRST, c, 12) == slice(2, 4)
    assert sub_slice(Part.FULL, Chunk(Part.SECOND, 1, 3), 12) == slice(8, 10)
    assert sub_slice(Part.SECOND, Chunk(Part.SECOND, 1, 3), 12) == slice(2, 4)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_tasp_plans_validate(n, causal):
    validate(build_plan(PlanOptions(method="tasp"), Layout(1, n), causal))


@pytest.mark.parametrize("n", [3, 4, 6])
@pytest.mark.parametrize("causal", [True, False])
def test_every_step_uses_every_link_once(n, causal):
    """At each step a rank sends one kv chunk to every other rank and receives one from each:
    every ordered pair carries exactly one chunk per step, TASP's link pattern."""
    plan = build_plan(PlanOptions(method="tasp"), Layout(1, n), causal)
    for prog in plan.forward:
        steps = [e for e in prog.instrs if isinstance(e, Exchange)]
        assert len(steps) == n - 1
        for t, ex in enumerate(steps):
            others = set(range(n)) - {prog.cp_rank}
            assert {op.peer for op in ex.ops if op.send} == others
            assert {op.peer for op in ex.ops if not op.send} == others
            assert {op.payload.part.index for op in ex.ops} == {t}
            assert all(op.payload.kind == Kind.KV for op in ex.ops)


@pytest.mark.parametrize("n", [3, 4, 6])
@pytest.mark.parametrize("causal", [True, False])
def test_moves_what_the_all_gather_moves(n, causal):
    """Chunks of the part each receiver uses: a rank sends and receives the same kv bytes as
    the all-gather, and its dk/dv partials return the same bytes, only in n - 1 steps."""
    shape = AttnShape(b=1, s_local=12 * 5, h=8, h_kv=2, d=16)
    tasp = plan_bytes(build_plan(PlanOptions(method="tasp"), Layout(1, n), causal), shape)
    gather = plan_bytes(build_plan(PlanOptions(method="all_gather"), Layout(1, n), causal), shape)
    for passes in zip(tasp, gather, strict=True):
        for x in range(n):
            assert passes[0][x] == passes[1][x], x


def test_shape_and_mask_refusals():
    layout = Layout(2, 2)
    check_shape(PlanOptions(method="tasp"), layout, AttnShape(b=1, s_local=12, h=8, h_kv=8, d=8))
    with pytest.raises(ValueError, match=r"s_local=2048 must be divisible by 2 \* \(cp_size - 1\)"):
        check_shape(
            PlanOptions(method="tasp"), layout, AttnShape(b=1, s_local=2048, h=8, h_kv=8, d=8)
        )
    from megatron_charm.plan import plan_with_levels

    model = DocMask((8, 8, 16)).model(4, True)
    with pytest.raises(ValueError, match="document mask"):
        plan_with_levels(
            PlanOptions(method="tasp"), Layout(1, 4), model.dense_causal, ("q", "q"), model.pattern
        )


def test_not_a_megatron_method():
    from megatron_charm.plan.options import BASELINES, MEGATRON_METHODS

    assert "tasp" in BASELINES and "tasp" not in MEGATRON_METHODS


def test_large_groups_check_each_rank_alone():
    # above FULL_CHECK_MAX_CP each rank plans and checks only its own programs
    from megatron_charm.function import FULL_CHECK_MAX_CP, checked_programs

    n = FULL_CHECK_MAX_CP + 2
    shape = AttnShape(b=1, s_local=2 * (n - 1), h=8, h_kv=8, d=16)
    for x in (0, n - 1):
        fwd, bwd = checked_programs(PlanOptions(method="tasp"), Layout(2, n // 2), True, x, shape)
        assert fwd.cp_rank == bwd.cp_rank == x
        assert len(fwd.exchanges()) == n - 1


def test_trainer_and_megatron_module_refuse_tasp():
    from megatron_charm.megatron.attention import CHARM_METHODS, resolve_method
    from megatron_charm.train.config import load_config

    with pytest.raises(ValueError, match=r"parallel.cp_comm_type='tasp' is a baseline"):
        load_config(None, ["parallel.cp_comm_type=tasp"])
    assert "tasp" not in CHARM_METHODS
    with pytest.raises(ValueError, match=r"cp_comm_type='tasp' is a baseline.*--cp-comm-type"):
        resolve_method("tasp", None, None)


def _backward(n: int, causal: bool, x: int = 0):
    return build_plan(PlanOptions(method="tasp"), Layout(1, n), causal).backward[x]


@pytest.mark.parametrize("n", [3, 4, 6])
@pytest.mark.parametrize("causal", [True, False])
def test_backward_returns_a_step_in_one_exchange(n, causal):
    """A step's dk/dv chunk partials go back in one exchange, as its kv came: to and from every
    other rank, and each received partial is merged by its sender."""
    for x in range(n):
        prog = _backward(n, causal, x)
        returns = [e for e in prog.exchanges() if e.channel == "full.o"]
        assert len(returns) == n - 1
        others = set(range(n)) - {x}
        for t, ex in enumerate(returns):
            assert {op.peer for op in ex.ops if op.send} == others
            assert {op.peer for op in ex.ops if not op.send} == others
            assert all(op.payload.kind is Kind.DKV and op.payload.part.index == t for op in ex.ops)
            merges = [m for m in prog.instrs if isinstance(m, Merge) and m.handle == ex.handle]
            assert sorted(m.peer for m in merges) == sorted(others)


def _one_sender_twice(prog: Program) -> Program:
    """``prog`` with the two merges of one exchange's equal partials both naming the first's
    sender."""
    instrs = list(prog.instrs)
    i, j = [k for k, m in enumerate(instrs) if isinstance(m, Merge)][:2]
    assert instrs[i].handle == instrs[j].handle and instrs[i].payload == instrs[j].payload
    assert instrs[i].peer != instrs[j].peer
    instrs[j] = dataclasses.replace(instrs[j], peer=instrs[i].peer)
    return Program(prog.cp_rank, tuple(instrs))


def _doubled_receive(prog: Program) -> Program:
    """``prog`` with the first partial receive of its first return exchange posted twice."""
    instrs = list(prog.instrs)
    k = next(k for k, e in enumerate(instrs) if isinstance(e, Exchange) and e.channel == "full.o")
    op = next(op for op in instrs[k].ops if not op.send)
    instrs[k] = dataclasses.replace(instrs[k], ops=(*instrs[k].ops, op))
    return Program(prog.cp_rank, tuple(instrs))


def test_both_checkers_tell_partials_apart_by_sender():
    """Rank 1 of 4 (causal) receives two dkv1.first chunks in one exchange, from ranks 2 and 3:
    merging one sender's twice, or posting a receive twice from one sender, is refused
    by the whole-plan replay and by the one-rank check."""
    plan = build_plan(PlanOptions(method="tasp"), Layout(1, 4), True)
    compact = compact_channels(plan.options)
    for mutate, message in (
        (_one_sender_twice, "merges .* which"),
        (_doubled_receive, "receives .* twice"),
    ):
        bad = list(plan.backward)
        bad[1] = mutate(bad[1])
        with pytest.raises(ScheduleError, match=message):
            validate(dataclasses.replace(plan, backward=tuple(bad)))
        with pytest.raises(ScheduleError, match=message):
            check_rank_program(bad[1], True, True, "zigzag", compact)
