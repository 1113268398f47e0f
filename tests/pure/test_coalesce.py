"""Note [Coalesced blocks]: which consecutive computes one kernel call does."""

from __future__ import annotations

from megatron_charm.plan import PlanOptions, build_plan
from megatron_charm.plan.coalesce import coalesced_runs
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Heads, Layout, Part, Wait

F, S, H0 = Part.FULL, Part.SECOND, Heads(0, 2)


def _c(z, y, qp=F, kvp=F, masked=False, heads=None):
    return Compute(z, y, qp, kvp, masked, heads)


def test_a_full_product_is_one_run():
    instrs = [_c(0, 4, S), _c(1, 4, S), _c(0, 5, S), _c(1, 5, S)]
    assert coalesced_runs(instrs) == {0: 4}


def test_a_run_stops_where_the_product_breaks():
    # the third block gives q0 a second part: the longest product from 0 is the first two
    instrs = [_c(0, 4), _c(1, 4), _c(0, 5, S), _c(1, 5)]
    assert coalesced_runs(instrs) == {0: 2, 2: 4}


def test_masked_blocks_waits_and_head_groups_are_never_joined():
    assert coalesced_runs([_c(0, 0, masked=True), _c(1, 0)]) == {}
    assert coalesced_runs([_c(0, 4), Wait(3), _c(1, 4)]) == {}
    assert coalesced_runs([_c(0, 4), _c(1, 4, heads=H0)]) == {}


def test_a_run_is_the_longest_product_though_a_shorter_one_is_not():
    # q0 x kv4 and q1 x kv5 are not a product (q0 x kv5 is missing); all four blocks are
    instrs = [_c(0, 4), _c(1, 5), _c(0, 5), _c(1, 4), _c(2, 4)]
    assert coalesced_runs(instrs) == {0: 4}


def test_a_repeated_pair_is_not_a_product():
    assert coalesced_runs([_c(0, 4), _c(0, 4)]) == {}


def test_runs_of_real_plans_are_unmasked_products_of_one_head_group():
    shape = AttnShape(1, 16, 8, 8, 8, 2)
    for method, layout in (
        ("a2a+p2p", Layout(2, 4)),
        ("charm", Layout(2, 2)),
        ("tasp", Layout(1, 4)),
    ):
        s = AttnShape(1, 12, 8, 8, 8, 2) if method == "tasp" else shape
        plan = build_plan(PlanOptions(method=method), layout, True, s)
        for prog in (*plan.forward, *plan.backward):
            for start, end in coalesced_runs(prog.instrs).items():
                run = prog.instrs[start:end]
                assert all(isinstance(c, Compute) and not c.masked for c in run)
                assert len({c.heads for c in run}) == 1
                q = {(c.q_owner, c.q_part) for c in run}
                kv = {(c.kv_owner, c.kv_part) for c in run}
                # one part per owner, and every (query piece, kv piece) pair exactly once
                assert len(q) == len({z for z, _ in q}) and len(kv) == len({y for y, _ in kv})
                assert sorted((c.q_owner, c.kv_owner) for c in run) == sorted(
                    (z, y) for z, _ in q for y, _ in kv
                )
    # the cross step of a2a+p2p on 2 x 4: every query piece of the node against every kv piece
    # of the other node, one call instead of 16
    prog = build_plan(PlanOptions(method="a2a+p2p"), Layout(2, 4), True, shape).backward[0]
    assert max(end - start for start, end in coalesced_runs(prog.instrs).items()) == 16
