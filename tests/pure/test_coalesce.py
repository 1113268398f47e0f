"""Note [Coalesced blocks]: which consecutive computes one kernel call does; Note [Summed
partials]: which consecutive merges one sum does."""

from __future__ import annotations

from megatron_charm.plan import METHODS, PlanOptions, build_plan
from megatron_charm.plan.coalesce import coalesced_runs, steps, summed_runs
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Heads, Kind, Layout, Merge, Part, Payload, Wait

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


def _m(kind, owner=3, part=F, peer=0, handle=7):
    return Merge(Payload(kind, owner, part), handle, peer)


def test_merges_of_one_gradient_piece_are_one_sum_and_outputs_are_not():
    dkv = [_m(Kind.DKV, peer=p) for p in (4, 5, 6)]
    assert summed_runs(dkv) == {0: 3}
    assert summed_runs([_m(Kind.DQ, peer=1), _m(Kind.DQ, peer=2)]) == {0: 2}
    # outputs merge by their lse; another piece, owner or a wait between ends a run
    assert summed_runs([_m(Kind.O, peer=1), _m(Kind.O, peer=2)]) == {}
    assert summed_runs([dkv[0], _m(Kind.DKV, part=S, peer=5), dkv[2]]) == {}
    assert summed_runs([dkv[0], _m(Kind.DKV, owner=2, peer=5)]) == {}
    assert summed_runs([dkv[0], Wait(7), dkv[1]]) == {}
    # steps joins them whether or not blocks are coalesced (not under a document mask)
    instrs = [_c(0, 4), _c(1, 4), *dkv]
    assert list(steps(instrs)) == [(0, 2), (2, 5)]
    assert list(steps(instrs, coalesce=False)) == [(0, 1), (1, 2), (2, 5)]


def test_tasps_backward_sums_a_steps_partials_and_no_other_method_has_runs():
    # n - 1 peers return this rank's chunk partial at every step: (n - 1)^2 merges, one sum per
    # chunk part and step (peers above and below use different parts under causal masking)
    n = 6
    s = AttnShape(1, 20, 4, 4, 8, 2)
    for causal, parts in ((True, 2), (False, 1)):
        for prog in build_plan(PlanOptions(method="tasp"), Layout(1, n), causal, s).backward:
            merges = [i for i in prog.instrs if isinstance(i, Merge)]
            assert len(merges) == (n - 1) ** 2
            ops = len(merges) - sum(e - b - 1 for b, e in summed_runs(prog.instrs).items())
            assert n - 1 <= ops <= parts * (n - 1), (causal, prog.cp_rank, ops)
    shape = AttnShape(1, 16, 8, 8, 8, 2)
    for method in METHODS:
        if method == "tasp":
            continue
        for layout in (Layout(2, 2), Layout(2, 4)):
            try:
                plan = build_plan(PlanOptions(method=method), layout, True, shape)
            except ValueError:
                continue  # a method that cannot split this shape
            for prog in (*plan.forward, *plan.backward):
                assert summed_runs(prog.instrs) == {}, (method, layout)
