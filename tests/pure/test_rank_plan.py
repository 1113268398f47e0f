"""Planning one rank (Note [Planning one rank]) and checking it alone (Note [Checking one rank]).

A rank of a large CP group builds only its own programs, deciding the wire precision of its
receives from the counts the generators put on them. These tests prove that this gives exactly the
programs of the whole plan, where every send's precision is copied to its receive, and that the
one-rank check catches what it claims to.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

import megatron_charm.function as fn
from megatron_charm.plan import (
    METHODS,
    Layout,
    PlanOptions,
    compact_channels,
    cross_levels,
    plan_levels,
    plan_with_levels,
    rank_plan,
    rank_programs,
)
from megatron_charm.plan.check_rank import check_rank_program
from megatron_charm.plan.docmask import DocMask
from megatron_charm.plan.types import Exchange, Merge, Program, Wait, Wire
from megatron_charm.plan.validate import ScheduleError
from megatron_charm.plan.wire import assign_wires, own_wires

LAYOUTS = [(1, 2), (1, 5), (2, 1), (2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (4, 2), (4, 4)]


def _cases():
    for method in METHODS:
        for m, p in LAYOUTS:
            for causal in (True, False):
                # ("q", "dout"): Note [Keeping foreign queries]
                crosses = (
                    [("q", "q"), ("kv", "kv"), ("q", "dout")]
                    if method == "charm" and m > 1
                    else [None]
                )
                # Note [Intra level]: from three ranks per node charm may exchange kv only
                intras = [SPLIT, ("kv", "kv")] if method == "charm" and p > 2 else [SPLIT]
                for cross, intra in itertools.product(crosses, intras):
                    for cross_return in ("fp32", "input"):
                        for combine in (False, True) if method == "charm" and m >= 2 else (False,):
                            yield method, m, p, causal, cross, intra, cross_return, combine


SPLIT = ("split", "split")
CASES = list(_cases())


def _options(method, cross_return, combine):
    return PlanOptions(method=method, cross_return=cross_return, combine_nodes=combine)


@pytest.mark.parametrize("method", METHODS)
def test_own_wires_equal_the_global_rule(method):
    """Every rank's own wire decisions equal the global copy from sender to receiver."""
    checked = 0
    for meth, m, p, causal, cross, intra, cross_return, combine in CASES:
        if meth != method:
            continue
        options, layout = _options(method, cross_return, combine), Layout(m, p)
        cross = cross or ("q", "q")
        fwd, bwd = rank_programs(options, layout, causal, range(layout.cp_size), cross, intra)
        compact = compact_channels(options)
        for progs, backward in ((fwd, False), (bwd, True)):
            for x, glob in enumerate(assign_wires(progs, backward, compact)):
                assert own_wires(progs[x], backward, compact) == glob, (
                    f"{method} {m}x{p} causal={causal} cross={cross} intra={intra} cp_rank {x}"
                )
                checked += 1
    assert checked > 0


def test_rank_plan_is_the_plans_program_and_passes_its_check():
    # the wires are proved on every case above; here a smaller grid shows that rank_plan is
    # the plan's program, with the check passing
    for method, m, p, causal, cross, intra, cross_return, combine in CASES:
        if (m, p) not in ((1, 5), (2, 1), (2, 3), (3, 2), (2, 4)) or cross_return != "fp32":
            continue
        options, layout = _options(method, cross_return, combine), Layout(m, p)
        cross = cross or cross_levels(options, layout, causal)
        plan = plan_with_levels(options, layout, causal, cross, intra=intra)
        compact = compact_channels(options)
        for x in range(layout.cp_size):
            fwd, bwd = rank_plan(options, layout, causal, cross, x, intra)
            assert (fwd, bwd) == (plan.forward[x], plan.backward[x]), (method, m, p, causal, x)
            check_rank_program(fwd, False, causal, options.seq_layout, compact)
            check_rank_program(bwd, True, causal, options.seq_layout, compact)


# --- the one-rank check fails on what it claims to catch -------------------------------------


def _charm(backward: bool, x: int = 1) -> tuple[Program, frozenset[str]]:
    options = PlanOptions()
    fwd, bwd = rank_plan(options, Layout(2, 2), True, ("q", "q"), x)
    return (bwd if backward else fwd), compact_channels(options)


def _check(prog: Program, backward: bool, compact: frozenset[str]) -> None:
    check_rank_program(prog, backward, True, "zigzag", compact)


def _without(prog: Program, index: int) -> Program:
    return replace(prog, instrs=prog.instrs[:index] + prog.instrs[index + 1 :])


def test_check_catches_a_missing_wait():
    prog, compact = _charm(False)
    i = next(k for k, ins in enumerate(prog.instrs) if isinstance(ins, Wait))
    with pytest.raises(ScheduleError, match="not received|never waits|did not deliver"):
        _check(_without(prog, i), False, compact)


def test_check_catches_a_missing_merge():
    prog, compact = _charm(False)
    i = next(k for k, ins in enumerate(prog.instrs) if isinstance(ins, Merge))
    with pytest.raises(ScheduleError, match="never merges|covering only"):
        _check(_without(prog, i), False, compact)


def test_check_catches_a_wrong_wire():
    prog, compact = _charm(True)
    for k, ins in enumerate(prog.instrs):
        if isinstance(ins, Exchange):
            for j, op in enumerate(ins.ops):
                if op.send and op.payload.kind.is_partial:
                    flipped = Wire.FP32 if op.wire == Wire.INPUT else Wire.INPUT
                    ops = ins.ops[:j] + (replace(op, wire=flipped),) + ins.ops[j + 1 :]
                    bad = prog.instrs[:k] + (replace(ins, ops=ops),) + prog.instrs[k + 1 :]
                    with pytest.raises(ScheduleError, match="sends .* in "):
                        _check(replace(prog, instrs=bad), True, compact)
                    return
    raise AssertionError("the charm backward sends no partial")


def test_check_catches_a_kept_partial_and_a_double_wait():
    prog, compact = _charm(True)
    # drop the first partial that the rank sends away: it ends holding another rank's partial
    k, ex = next(
        (k, ins)
        for k, ins in enumerate(prog.instrs)
        if isinstance(ins, Exchange) and any(o.send and o.payload.kind.is_partial for o in ins.ops)
    )
    ops = tuple(op for op in ex.ops if not (op.send and op.payload.kind.is_partial))
    assert ops, "the exchange also receives, so it stays"
    bad = prog.instrs[:k] + (replace(ex, ops=ops),) + prog.instrs[k + 1 :]
    with pytest.raises(ScheduleError, match=r"another rank|holds|blocks\) in"):
        _check(replace(prog, instrs=bad), True, compact)
    w = next(ins for ins in prog.instrs if isinstance(ins, Wait))
    with pytest.raises(ScheduleError, match="never posted or waited twice"):
        _check(replace(prog, instrs=prog.instrs + (w,)), True, compact)


# --- the executor's choice -------------------------------------------------------------------


def test_large_groups_plan_one_rank_and_skip_the_full_replay(monkeypatch):
    options, layout = PlanOptions(), Layout(4, 2)
    cross, intra = plan_levels(options, layout, True)
    want = plan_with_levels(options, layout, True, cross, intra=intra)

    def no_replay(*_a, **_k):
        raise AssertionError("a group above FULL_CHECK_MAX_CP replayed the whole plan")

    monkeypatch.setattr(fn, "FULL_CHECK_MAX_CP", 4)
    monkeypatch.setattr(fn, "_validated", no_replay)
    for x in range(layout.cp_size):
        assert fn.checked_programs(options, layout, True, x) == (want.forward[x], want.backward[x])


def test_small_groups_and_masks_replay_the_whole_plan(monkeypatch):
    calls = []
    real = fn._validated

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(fn, "_validated", spy)
    fn.checked_programs(PlanOptions(), Layout(2, 2), True, 0)
    assert calls, "a group of 4 must be replayed in full"
    monkeypatch.setattr(fn, "FULL_CHECK_MAX_CP", 1)
    calls.clear()
    model = DocMask((8, 24)).model(4, True)
    fn.checked_programs(PlanOptions(), Layout(2, 2), model.dense_causal, 0, None, model.pattern)
    assert calls, "a plan pruned to a mask must be replayed in full whatever the CP size"


def test_render_validate_replays_a_group_offline(capsys):
    from megatron_charm.plan import render

    render.main(["--nodes", "2", "--ranks-per-node", "4", "--validate", "--window", "1"])
    out = capsys.readouterr().out
    assert out.startswith("valid: PlanOptions(method='charm', window=1") and "on 2x4, causal" in out


def test_render_lists_a_cp_rank_under_either_flag_and_takes_no_abbreviations(capsys):
    from megatron_charm.plan import render

    base = ["--method", "ring", "--nodes", "1", "--ranks-per-node", "4", "--no-matrix"]
    render.main([*base, "--cp-rank", "1"])
    new = capsys.readouterr().out
    render.main([*base, "--rank", "1"])
    assert new.startswith("cp_rank 1, forward:") and capsys.readouterr().out == new
    # "--ranks" once abbreviated --ranks-per-node; a typo must not change the layout silently
    with pytest.raises(SystemExit):
        render.main(["--method", "ring", "--nodes", "1", "--ranks", "4"])
    for outside in ("4", "-1"):
        with pytest.raises(SystemExit):
            render.main([*base, "--cp-rank", outside])
        assert f"--cp-rank {outside}: a CP position is 0..3 on 1 x 4" in capsys.readouterr().err


def test_render_refuses_kv_heads_of_zero_where_it_took_the_query_heads(capsys):
    from megatron_charm.plan import render

    with pytest.raises(SystemExit):
        render.main(["--heads", "4", "--kv-heads", "0", "--no-matrix"])
    assert "--kv-heads 0" in capsys.readouterr().err
