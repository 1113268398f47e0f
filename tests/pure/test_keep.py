"""Note [Keeping foreign queries]: the backward completes cross-node bundles with the q pieces
its rank received in the forward, instead of receiving them again."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_charm.plan import (
    AttnShape,
    Layout,
    PlanOptions,
    build_plan,
    plan_levels,
    plan_with_levels,
)
from megatron_charm.plan.cost import cross_link_bytes
from megatron_charm.plan.keep import kept_pieces
from megatron_charm.plan.memory import attention_memory
from megatron_charm.plan.payloads import payload_bytes
from megatron_charm.plan.types import Exchange, Kind, Wire
from megatron_charm.plan.validate import ScheduleError, validate

MHA = AttnShape(b=1, s_local=2048, h=8, h_kv=8, d=64, itemsize=2)


def _plan(foreign_q: str, layout: Layout, causal: bool = True):
    return build_plan(PlanOptions(cross_level="q", foreign_q=foreign_q), layout, causal, MHA)


def _cross_q_receives(prog, layout):
    node = layout.node(prog.cp_rank)
    return {
        op.payload
        for ex in prog.exchanges()
        for op in ex.ops
        if not op.send and op.payload.kind is Kind.Q and layout.node(op.peer) != node
    }


@pytest.mark.parametrize("m,p", [(2, 1), (2, 2), (2, 4), (3, 2), (4, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_every_forward_q_piece_is_kept_and_no_bundle_crosses_with_q(m, p, causal):
    layout = Layout(m, p)
    plan = _plan("keep", layout, causal)
    assert plan.cross == ("q", "dout")
    validate(plan)
    for f, b in zip(plan.forward, plan.backward, strict=True):
        assert kept_pieces(b) == _cross_q_receives(f, layout) != frozenset()
        node = layout.node(b.cp_rank)
        crossing = {
            op.payload.kind
            for ex in b.exchanges()
            for op in ex.ops
            if layout.node(op.peer) != node and not op.payload.kind.is_partial
        }
        assert crossing == {Kind.DB}


@pytest.mark.parametrize("m,p", [(2, 2), (2, 4), (3, 2)])
def test_keeping_saves_exactly_the_q_bytes_on_the_backward_cross_links(m, p):
    layout = Layout(m, p)
    keep, resend = _plan("keep", layout), _plan("resend", layout)
    assert resend.cross == ("q", "q")
    # the forward is the same program; the backward differs only by the bundles' q
    assert keep.forward == resend.forward
    saved = sum(
        payload_bytes(piece, MHA, Wire.INPUT) for b in keep.backward for piece in kept_pieces(b)
    )
    links_keep = cross_link_bytes(keep.backward, layout, MHA)
    links_resend = cross_link_bytes(resend.backward, layout, MHA)
    assert sum(links_resend.values()) - sum(links_keep.values()) == saved > 0
    # with MHA the q is half of the bundle: the busiest link loses at least a third
    assert max(links_keep.values()) <= 2 / 3 * max(links_resend.values())


def test_kept_pieces_count_in_both_passes_and_between_them():
    layout = Layout(2, 2)
    keep, resend = _plan("keep", layout), _plan("resend", layout)
    for x in range(layout.cp_size):
        k = attention_memory(keep.forward[x], keep.backward[x], MHA)
        r = attention_memory(resend.forward[x], resend.backward[x], MHA)
        held = sum(payload_bytes(p, MHA, Wire.INPUT) for p in kept_pieces(keep.backward[x]))
        assert k["kept"] == held > 0 and r["kept"] == 0
        # held to the end of the forward, which otherwise releases them after their last use
        assert r["fwd"] < k["fwd"] <= r["fwd"] + held
        assert r["bwd"] <= k["bwd"] <= r["bwd"] + held


def test_a_bundle_without_its_forward_piece_fails_the_replay():
    layout = Layout(2, 2)
    keep = _plan("keep", layout)
    # a forward that never received q across nodes (kv crossed instead)
    kv = build_plan(PlanOptions(cross_level="kv"), layout, True, MHA)
    broken = replace(keep, forward=kv.forward)
    with pytest.raises(ScheduleError, match="received 0 times forward"):
        validate(broken)


def test_auto_keeps_for_mha_and_never_where_kv_crosses():
    options = PlanOptions()
    for layout in (Layout(2, 2), Layout(2, 4), Layout(4, 4)):
        assert plan_levels(options, layout, True, MHA)[0] == ("q", "dout")
        gqa = replace(MHA, h_kv=2)
        assert plan_levels(options, layout, True, gqa)[0] == ("kv", "kv")
    resend = PlanOptions(foreign_q="resend")
    assert plan_levels(resend, Layout(2, 2), True, MHA)[0] == ("q", "q")
    assert plan_levels(options, Layout(1, 4), True, MHA)[0] == ("q", "q")


def test_auto_keeps_unless_that_takes_memory_above_the_budget_and_above_resending():
    # 2 x 2: keeping leaves the largest rank's peak where resending has it, whatever the budget
    tight = PlanOptions(memory_budget=0.01)
    assert plan_levels(tight, Layout(2, 2), True, MHA)[0] == ("q", "dout")
    # 3 x 4 causal: keeping raises the largest peak; a tight budget resends, a loose one keeps
    assert plan_levels(tight, Layout(3, 4), True, MHA)[0] == ("q", "q")
    loose = PlanOptions(memory_budget=100.0)
    assert plan_levels(loose, Layout(3, 4), True, MHA)[0] == ("q", "dout")


def test_auto_keep_builds_the_resending_plans_only_past_the_budget(monkeypatch):
    """Within the budget the answer is "keep" whatever resending holds: a rank's first call
    does not build them (a CP group's first call pays these choices, at every size)."""
    import megatron_charm.plan as planner

    built = []
    real = planner.rank_plan

    def recording(options, layout, causal, cross, *rest):
        built.append(cross)
        return real(options, layout, causal, cross, *rest)

    monkeypatch.setattr(planner, "rank_plan", recording)
    for budget, resends in ((100.0, False), (0.01, True)):
        planner._auto_keep.cache_clear()
        built.clear()
        options = PlanOptions(memory_budget=budget)
        plan_levels(options, Layout(3, 4), True, MHA)
        assert (("q", "q") in built) == resends, budget
        assert ("q", "dout") in built


def test_foreign_q_is_validated():
    with pytest.raises(ValueError, match="foreign_q='always'.*keep, resend"):
        PlanOptions(foreign_q="always")


@pytest.mark.parametrize("m,p", [(2, 2), (2, 4), (3, 2), (4, 4)])
def test_auto_ships_q_in_both_passes_where_keeping_makes_that_move_less(m, p):
    # Note [Cross level]: non-causal MHA ships kv in the forward by itself (fewer bytes there),
    # but q in both passes, the backward keeping the queries, moves fewer over the two passes
    layout = Layout(m, p)
    resend = PlanOptions(foreign_q="resend")
    assert plan_levels(resend, layout, False, MHA)[0] == ("kv", "q")
    cross, intra = plan_levels(PlanOptions(), layout, False, MHA)
    assert cross == ("q", "dout")

    def busiest(options, levels, lv_intra):
        plan = plan_with_levels(options, layout, False, levels, intra=lv_intra)
        return sum(
            max(cross_link_bytes(plan.programs(bwd), layout, MHA).values()) for bwd in (0, 1)
        )

    per_pass, per_pass_intra = plan_levels(resend, layout, False, MHA)
    assert busiest(PlanOptions(), cross, intra) < busiest(resend, per_pass, per_pass_intra)
    # GQA: kv in both passes still moves less; the forced levels are left alone
    assert plan_levels(PlanOptions(), layout, False, replace(MHA, h_kv=2))[0] == ("kv", "kv")
    kv = PlanOptions(cross_level="kv")
    assert plan_levels(kv, layout, False, MHA)[0] == ("kv", "kv")


def test_a_bundle_from_another_rank_than_its_forward_piece_fails_the_replay():
    layout = Layout(2, 2)
    keep = _plan("keep", layout)
    prog = keep.backward[0]
    # rank 0 receives its first DB from rank 2 (its counterpart); name rank 3 instead
    instrs = list(prog.instrs)
    for i, ins in enumerate(instrs):
        if isinstance(ins, Exchange) and any(
            not op.send and op.payload.kind is Kind.DB for op in ins.ops
        ):
            ops = tuple(
                replace(op, peer=3) if not op.send and op.payload.kind is Kind.DB else op
                for op in ins.ops
            )
            instrs[i] = replace(ins, ops=ops)
            break
    backward = list(keep.backward)
    backward[0] = replace(prog, instrs=tuple(instrs))
    with pytest.raises(ScheduleError, match="but its q came from 2 forward"):
        validate(replace(keep, backward=tuple(backward)))
