"""Issue rule: charm never moves more bytes across nodes than ring attention, for any head ratio.

For every shape of the grid, charm's default plan (``cross_level="auto"``) carries no more bytes
than ring on its busiest directed cross-node link, and no more in total, in both passes, with the
nodes sharing one link per node pair (``shared``) or one link per local index (``rails``).
"""

from __future__ import annotations

import pytest

from megatron_charm.plan import AttnShape, Layout, PlanOptions, build_plan, cross_levels
from megatron_charm.plan.cost import cross_link_bytes
from megatron_charm.plan.types import Compute, Kind, Part, Wait

H = 16
RATIOS = [1, 2, 4, 8, H]
LAYOUTS = [(2, 2), (2, 4), (2, 8), (4, 4)]


def _links(plan, layout, shape, backward, rails):
    return cross_link_bytes(plan.programs(backward), layout, shape, rails)


@pytest.mark.parametrize("mp", LAYOUTS, ids=[f"{m}x{p}" for m, p in LAYOUTS])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cross_return", ["fp32", "input"])
def test_charm_never_moves_more_across_nodes_than_ring(mp, causal, cross_return):
    layout = Layout(*mp)
    ring = build_plan(PlanOptions(method="ring"), layout, causal)
    for g in RATIOS:
        shape = AttnShape(b=1, s_local=64, h=H, h_kv=H // g, d=64, itemsize=2)
        charm = build_plan(PlanOptions(cross_return=cross_return), layout, causal, shape)
        for backward in (False, True):
            for rails in (False, True):
                ours = _links(charm, layout, shape, backward, rails)
                theirs = _links(ring, layout, shape, backward, rails)
                where = f"g={g} backward={backward} rails={rails} cross={charm.cross}"
                assert max(ours.values()) <= max(theirs.values()), where
                assert sum(ours.values()) <= sum(theirs.values()), where


@pytest.mark.parametrize("causal", [True, False])
def test_gqa_ships_kv_and_mha_keeps_queries_where_they_win(causal):
    layout = Layout(2, 4)
    for g in (2, 4, 8, H):
        shape = AttnShape(1, 64, H, H // g, 64, 2)
        assert cross_levels(PlanOptions(), layout, causal, shape) == ("kv", "kv"), g
    # causal MHA with returns in the input dtype: the halves of q and its results move fewer
    # bytes forward than whole kv blocks (without a mask, the lse tips it towards kv)
    mha = AttnShape(1, 64, H, H, 64, 2)
    forward = cross_levels(PlanOptions(cross_return="input"), layout, causal, mha)[0]
    assert forward == ("q" if causal else "kv")
    # an explicit level is kept; other methods and one node have no cross level
    assert cross_levels(PlanOptions(cross_level="q"), layout, causal, shape) == ("q", "q")
    assert cross_levels(PlanOptions(method="rm+"), layout, causal, shape) == ("q", "q")
    assert cross_levels(PlanOptions(), Layout(1, 8), causal, shape) == ("q", "q")


@pytest.mark.parametrize("mp", [(2, 2), (3, 2), (4, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_kv_level_keeps_queries_inside_nodes_and_kv_crosses_once(mp, causal):
    layout = Layout(*mp)
    m, p = mp
    plan = build_plan(PlanOptions(cross_level="kv"), layout, causal)
    assert plan.cross == ("kv", "kv")
    for backward in (False, True):
        for prog in plan.programs(backward):
            crossing = [
                (ex.channel, op)
                for ex in prog.exchanges()
                for op in ex.ops
                if op.send and layout.node(op.peer) != layout.node(prog.cp_rank)
            ]
            kinds = {op.payload.kind for _, op in crossing}
            assert kinds <= ({Kind.KV, Kind.DKV} if backward else {Kind.KV})
            # kv of this rank crosses once to each other node, to the rank with its local
            # index: whole, or as two disjoint halves (no part twice)
            kv_sends = [op for _, op in crossing if op.payload.kind == Kind.KV]
            assert {layout.local(op.peer) for op in kv_sends} == {layout.local(prog.cp_rank)}
            assert all(op.payload.owner == prog.cp_rank for op in kv_sends)
            per_node: dict[int, list[Part]] = {}
            for op in kv_sends:
                per_node.setdefault(layout.node(op.peer), []).append(op.payload.part)
            assert len(per_node) == m - 1
            for parts in per_node.values():
                assert sum(part.fraction for part in parts) <= 1.0 and len(set(parts)) == len(parts)


@pytest.mark.parametrize("mp", [(2, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_kv_level_backward_computes_its_own_diagonal_before_any_wait(mp, causal):
    # Note [Own diagonal ahead]: the own block needs no input, so no rank's backward starts by
    # waiting for the first kv piece to cross
    plan = build_plan(PlanOptions(cross_level="kv"), Layout(*mp), causal)
    assert plan.cross[1] == "kv"
    for prog in plan.backward:
        first = next(i for i in prog.instrs if isinstance(i, (Compute, Wait)))
        assert isinstance(first, Compute), (prog.cp_rank, first)
        assert first.q_owner == first.kv_owner == prog.cp_rank
        owns = [i for i in prog.instrs if isinstance(i, Compute) and i.q_owner == i.kv_owner]
        assert owns == [first]  # and it is not computed a second time
