"""a2a+charm on the planner (Note [A2a+charm schedule]): valid plans, kv that never crosses nodes,
returns that are merged rather than placed, and refusals."""

from __future__ import annotations

import pytest

from megatron_charm.plan import AttnShape, Layout, PlanOptions, build_plan, check_shape
from megatron_charm.plan.types import Kind, Wire
from megatron_charm.plan.validate import validate
from megatron_charm.plan.wire import placed

LAYOUTS = [(2, 1), (2, 2), (3, 2), (2, 4), (4, 2), (3, 3)]


@pytest.mark.parametrize("m,p", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_plans_validate(m, p, causal):
    # every block once, every partial merged into its owner's accumulator, no deadlock
    validate(build_plan(PlanOptions(method="a2a+charm"), Layout(m, p), causal))


@pytest.mark.parametrize("m,p", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("foreign_q", ["keep", "resend"])
def test_kv_never_crosses_nodes(m, p, causal, foreign_q):
    # the backward sends the bundle with the query, or without it when the receiver kept the
    # forward's (Note [Keeping foreign queries])
    layout = Layout(m, p)
    plan = build_plan(PlanOptions(method="a2a+charm", foreign_q=foreign_q), layout, causal)
    bundle = Kind.DB if foreign_q == "keep" else Kind.QB
    for backward in (False, True):
        crossing = {
            op.payload.kind
            for prog in plan.programs(backward)
            for ex in prog.exchanges()
            for op in ex.ops
            if op.send and layout.node(op.peer) != layout.node(prog.cp_rank)
        }
        want = {bundle, Kind.DQ} if backward else {Kind.Q, Kind.O}
        assert crossing == want


def test_cross_returns_merge_at_their_owner():
    # The return of member (b, l)'s query goes to (b, l) itself: a head-group partial to its
    # owner that is not complete (the owner's node adds its own blocks), so it is merged, and it
    # travels as merged partials do: float32, or the input dtype on the compact cross.o
    layout = Layout(2, 2)
    for cross_return, wire in (("fp32", Wire.FP32), ("input", Wire.INPUT)):
        plan = build_plan(PlanOptions(method="a2a+charm", cross_return=cross_return), layout, True)
        ops = [
            (prog.cp_rank, op)
            for prog in plan.forward
            for ex in prog.exchanges()
            if ex.channel == "cross.o"
            for op in ex.ops
        ]
        assert ops and all(op.merged and op.wire is wire for _, op in ops)
        to_owner = [(x, op) for x, op in ops if op.send and op.peer == op.payload.owner]
        assert to_owner and not any(placed(op, x) for x, op in to_owner)


def test_auto_keeps_the_forwards_queries_within_the_memory_budget():
    # MHA and GQA 4:1 on 2 x 2 and 2 x 4: keeping costs one query piece per node pair
    for layout in (Layout(2, 2), Layout(2, 4)):
        for h_kv in (8, 2 if layout.ranks_per_node == 2 else 4):
            shape = AttnShape(b=1, s_local=2048, h=8, h_kv=h_kv, d=64)
            plan = build_plan(PlanOptions(method="a2a+charm"), layout, True, shape)
            assert plan.cross == ("q", "dout"), (layout, h_kv)


def test_heads_must_split_over_a_node():
    opts, layout = PlanOptions(method="a2a+charm"), Layout(2, 4)
    check_shape(opts, layout, AttnShape(b=1, s_local=8, h=8, h_kv=4, d=8))
    with pytest.raises(ValueError, match=r"a2a\+charm.*h_kv=2.*ranks_per_node=4"):
        check_shape(opts, layout, AttnShape(b=1, s_local=8, h=8, h_kv=2, d=8))


def test_offered_for_comparison_only():
    from megatron_charm.megatron.attention import CHARM_METHODS, resolve_method
    from megatron_charm.plan.options import BASELINES, MEGATRON_METHODS

    assert "a2a+charm" in BASELINES and "a2a+charm" not in MEGATRON_METHODS
    assert "a2a+charm" not in CHARM_METHODS
    with pytest.raises(ValueError, match=r"cp_comm_type='a2a\+charm' is a baseline"):
        resolve_method("a2a+charm", None, None)


def test_large_groups_check_each_rank_alone():
    # above FULL_CHECK_MAX_CP each rank plans and checks only its own programs
    from megatron_charm.function import FULL_CHECK_MAX_CP, checked_programs

    p = FULL_CHECK_MAX_CP // 2 + 1
    shape = AttnShape(b=1, s_local=8, h=p, h_kv=p, d=16)
    for x in (0, 2 * p - 1):
        fwd, bwd = checked_programs(PlanOptions(method="a2a+charm"), Layout(2, p), True, x, shape)
        assert fwd.cp_rank == bwd.cp_rank == x
        assert sum(ex.channel == "cross.q" for ex in fwd.exchanges()) == p
