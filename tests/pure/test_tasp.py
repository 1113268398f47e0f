"""TASP on the planner (Note [TASP schedule]): chunks, the link pattern, bytes and refusals."""

from __future__ import annotations

import pytest

from megatron_charm.plan import AttnShape, Layout, PlanOptions, build_plan, check_shape
from megatron_charm.plan.cost import plan_bytes
from megatron_charm.plan.docmask import DocMask
from megatron_charm.plan.layout import part_span, sub_slice
from megatron_charm.plan.types import Chunk, Exchange, Kind, Part
from megatron_charm.plan.validate import validate


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
