"""Exhaustive plan validation: every method, every n <= 16, every node split, both passes."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_charm.plan import METHODS, Layout, PlanOptions, build_plan
from megatron_charm.plan.partners import num_levels, partner_tasks
from megatron_charm.plan.types import (
    Compute,
    Exchange,
    Heads,
    Merge,
    Op,
    Part,
    Payload,
    Wait,
    Wire,
)
from megatron_charm.plan.validate import ScheduleError, validate


def plan_of(method, layout, causal, **options):
    return build_plan(PlanOptions(method=method, **options), layout, causal)


SPLITS = [(n, p) for n in range(1, 17) for p in range(1, n + 1) if n % p == 0]


@pytest.mark.parametrize("n,p", SPLITS, ids=[f"{n // p}x{p}" for n, p in SPLITS])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_every_plan_validates(n, p, causal):
    for method in METHODS:
        if method not in ("charm", "a2a+p2p") and p != n:
            continue  # flat methods ignore the node split
        if method in ("a2a", "a2a+p2p") and n > 8:
            continue  # n**3 blocks per pass; its offsets are regular, the sizes below cover them
        variants = [False, True] if method == "charm" and n // p >= 2 else [False]
        for combine in variants:
            levels = ["q", "kv"] if method == "charm" and n // p > 1 and not combine else ["q"]
            for level in levels:
                plan = plan_of(
                    method, Layout(n // p, p), causal, combine_nodes=combine, cross_level=level
                )
                _check_balanced(plan, n, causal)


def _check_balanced(plan, n, causal):
    fwd, bwd = validate(plan)
    if causal and plan.options.seq_layout == "contiguous":
        return  # unbalanced by design: tests/pure/test_ring_contig.py
    # balanced: every rank does the work of n blocks (a block may run as two query halves)
    unit = 0.5 if causal else 1.0
    for report in (fwd, bwd):
        assert {round(c, 9) for c in report.cost.values()} == {n * unit}
        assert min(report.blocks.values()) >= n


def _algorithm1(x: int, n: int) -> tuple[list[int], list[int]]:
    """Paper Algorithm 1, literally (power-of-two n): (commList_kv, commList_q)."""
    tmp, level = [], 1
    while level < n:
        tmp.append(sorted(x ^ i for i in range(level, 2 * level)))
        level *= 2
    g1, g2 = [tmp[0]], []
    g3 = sorted(set(tmp[0]) | {x})
    for g in tmp[1:]:
        first, second = g[: len(g) // 2], g[len(g) // 2 :]
        if g3.index(x) < len(g3) // 2:
            g1.append(first)
            g2.append(second)
        else:
            g1.append(second)
            g2.append(first)
        g3 = sorted(set(g3) | set(g))
    return [y for grp in g1 for y in grp], [y for grp in g2 for y in grp]


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_split_equals_algorithm1(n):
    for x in range(n):
        kv, q = _algorithm1(x, n)
        tasks = partner_tasks(x, n, split=True)
        assert sorted(t.peer_local for t in tasks if t.exchange_kv) == sorted(kv)
        assert sorted(t.peer_local for t in tasks if not t.exchange_kv) == sorted(q)


@pytest.mark.parametrize("n", range(1, 20))
def test_split_is_symmetric_and_complete(n):
    for x in range(n):
        tasks = partner_tasks(x, n, split=True)
        assert sorted(t.peer_local for t in tasks) == [y for y in range(n) if y != x]
        assert len({t.level for t in tasks} | {0}) <= max(1, num_levels(n))
        for t in tasks:
            back = next(u for u in partner_tasks(t.peer_local, n, True) if u.peer_local == x)
            assert (back.level, back.j, back.exchange_kv) == (t.level, t.j, t.exchange_kv)


def test_merge_levels_are_log2():
    assert [num_levels(p) for p in (1, 2, 3, 4, 5, 8, 9, 16)] == [0, 1, 2, 2, 3, 3, 4, 4]


# --- the validator catches broken plans -------------------------------------------------------


def _mutated(plan, cp_rank, fn, backward=False):
    """A copy of ``plan`` whose program of ``cp_rank`` is ``fn(list of instructions)``."""
    progs = list(plan.programs(backward))
    instrs = list(progs[cp_rank].instrs)
    fn(instrs)
    progs[cp_rank] = dataclasses.replace(progs[cp_rank], instrs=tuple(instrs))
    return dataclasses.replace(plan, **{"backward" if backward else "forward": tuple(progs)})


def _index_in(instrs, cls, k=0):
    return [i for i, ins in enumerate(instrs) if isinstance(ins, cls)][k]


def test_validator_catches_missing_block():
    plan = plan_of("rm+", Layout(1, 8), True)
    bad = _mutated(plan, 3, lambda ins: ins.pop(_index_in(ins, Compute, 2)))
    with pytest.raises(ScheduleError, match="never computed|wrong accumulators|holds None"):
        validate(bad)


def test_validator_catches_reordered_exchanges():
    # rank 0 posts its level-0 exchange (with rank 1) last: 1 waits for 0, 0 for 3, 3 for 1
    plan = plan_of("merge", Layout(1, 4), False, window=8)

    def rotate(instrs):
        idx = [i for i, ins in enumerate(instrs) if isinstance(ins, Exchange)]
        first = instrs.pop(idx[0])
        instrs.insert(idx[-1], first)

    with pytest.raises(ScheduleError, match="deadlock"):
        validate(_mutated(plan, 0, rotate))


def test_validator_catches_unmerged_partial():
    plan = plan_of("charm", Layout(2, 4), True)
    bad = _mutated(plan, 5, lambda ins: ins.pop(_index_in(ins, Merge)))
    with pytest.raises(ScheduleError, match="never merged|wrong accumulators"):
        validate(bad)


def test_validator_catches_use_before_wait():
    plan = plan_of("ring", Layout(1, 4), True)

    def late_wait(instrs):
        instrs.append(instrs.pop(_index_in(instrs, Wait)))

    with pytest.raises(ScheduleError, match="not received|does not hold"):
        validate(_mutated(plan, 1, late_wait))


def test_validator_catches_mismatched_payload():
    plan = plan_of("rm+", Layout(1, 4), True)

    def wrong_part(instrs):
        i = _index_in(instrs, Exchange)
        ex = instrs[i]
        ops = list(ex.ops)
        k = next(k for k, o in enumerate(ops) if not o.send)
        pl = ops[k].payload
        other = Part.FIRST if pl.part == Part.FULL else Part.FULL
        ops[k] = Op(False, ops[k].peer, Payload(pl.kind, pl.owner, other))
        instrs[i] = Exchange(ex.handle, ex.channel, tuple(ops))

    with pytest.raises(ScheduleError, match="posts"):
        validate(_mutated(plan, 2, wrong_part))


def _flip_first_partial_wire(instrs, send):
    """Flip the wire precision of the first partial op (a send or a receive)."""
    for i, ins in enumerate(instrs):
        if not isinstance(ins, Exchange):
            continue
        for k, op in enumerate(ins.ops):
            if op.send == send and op.payload.kind.is_partial:
                flipped = Wire.FP32 if op.wire == Wire.INPUT else Wire.INPUT
                ops = list(ins.ops)
                ops[k] = dataclasses.replace(op, wire=flipped)
                instrs[i] = dataclasses.replace(ins, ops=tuple(ops))
                return
    raise AssertionError("no partial op")


def test_validator_catches_receive_with_other_wire_precision():
    # the receiver would allocate a buffer of the wrong size: gloo may accept a short message
    plan = plan_of("charm", Layout(2, 2), False, cross_level="q")
    bad = _mutated(plan, 1, lambda ins: _flip_first_partial_wire(ins, send=False))
    with pytest.raises(ScheduleError, match="posts"):
        validate(bad)


@pytest.mark.parametrize("backward", [False, True])
def test_validator_catches_wasteful_or_lossy_send(backward):
    # a single block sent in float32 (twice the bytes) or a merged partial sent in the input
    # dtype on an exact channel (one more rounding): the sender's precision breaks the rule
    plan = plan_of("charm", Layout(2, 2), True, cross_level="q")
    bad = _mutated(plan, 0, lambda ins: _flip_first_partial_wire(ins, send=True), backward)
    with pytest.raises(ScheduleError, match="float32|input dtype|posts"):
        validate(bad)


def test_plans_are_immutable_and_shared():
    plan = plan_of("charm", Layout(2, 2), True)
    assert plan is plan_of("charm", Layout(2, 2), True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.forward[0].instrs = ()  # type: ignore[misc]
    assert isinstance(plan.forward, tuple) and isinstance(plan.forward[0].instrs, tuple)


def test_plan_options_are_checked():
    with pytest.raises(ValueError, match="unknown CP attention method 'nope'"):
        PlanOptions(method="nope")
    with pytest.raises(ValueError, match="window=0"):
        PlanOptions(window=0)
    with pytest.raises(ValueError, match="cross_return='bf16'"):
        PlanOptions(cross_return="bf16")
    with pytest.raises(ValueError, match="unknown plan option"):
        PlanOptions.from_dict({"windw": 2})


@pytest.mark.parametrize("n", [1, 2, 5, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_all_gather_posts_the_gather_before_computing(n, causal):
    # the gather overlaps the own block, and each block waits only for the kv it uses
    plan = plan_of("all_gather", Layout(1, n), causal)
    for backward in (False, True):
        for prog in plan.programs(backward):
            instrs = prog.instrs
            first = _index_in(instrs, Compute)
            assert [type(i) for i in instrs[:first]] == [Exchange] * (n - 1)
            assert (instrs[first].q_owner, instrs[first].kv_owner) == (prog.cp_rank,) * 2
            delivers = {
                ins.handle: op.payload.owner
                for ins in instrs[:first]
                for op in ins.ops
                if not op.send
            }
            for k, ins in enumerate(instrs):
                if isinstance(ins, Wait) and ins.handle in delivers:
                    nxt = next(i for i in instrs[k:] if isinstance(i, Compute))
                    assert nxt.kv_owner == delivers[ins.handle]


@pytest.mark.parametrize("n", [1, 2, 5, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_a2a_posts_the_all_to_all_before_computing(n, causal):
    # every input exchange before the own block; whole tokens of one head group each way;
    # every block on this rank's head group
    plan = plan_of("a2a", Layout(1, n), causal)
    for backward in (False, True):
        for prog in plan.programs(backward):
            x, instrs = prog.cp_rank, prog.instrs
            first = _index_in(instrs, Compute)
            assert [type(i) for i in instrs[:first]] == [Exchange] * 2 * (n - 1)
            assert (instrs[first].q_owner, instrs[first].kv_owner) == (x, x)
            for ins in instrs[:first]:
                for op in ins.ops:
                    group = op.peer if op.send else x
                    assert op.payload.heads == Heads(group, n) and op.payload.part == Part.FULL
            assert {c.heads for c in prog.computes()} == {Heads(x, n)}
            assert len(prog.computes()) == n * n


def _a2a_first_return(instrs):
    return next(
        i for i, ins in enumerate(instrs) if isinstance(ins, Exchange) and ins.channel == "full.o"
    )


@pytest.mark.parametrize(
    "mutate,message",
    [
        # the block right before the first return: that result leaves incomplete
        (lambda ins: ins.pop(_a2a_first_return(ins) - 1), "before it is complete"),
        # a complete head-group result sent in float32
        (
            lambda ins: ins.__setitem__(
                _a2a_first_return(ins),
                dataclasses.replace(
                    ins[_a2a_first_return(ins)],
                    ops=tuple(
                        dataclasses.replace(op, wire=Wire.FP32) if op.send else op
                        for op in ins[_a2a_first_return(ins)].ops
                    ),
                ),
            ),
            "in float32",
        ),
        # a returned head group never placed
        (lambda ins: ins.pop(_index_in(ins, Merge)), "never merged"),
        # the own block on another rank's head group
        (
            lambda ins: ins.__setitem__(
                _index_in(ins, Compute),
                dataclasses.replace(ins[_index_in(ins, Compute)], heads=Heads(0, 4)),
            ),
            "twice",
        ),
    ],
    ids=["incomplete", "fp32", "unplaced", "wrong-group"],
)
def test_validator_checks_head_groups(mutate, message):
    plan = plan_of("a2a", Layout(1, 4), True)
    with pytest.raises(ScheduleError, match=message):
        validate(_mutated(plan, 1, mutate))


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_two_node_forward_computes_the_first_foreign_piece_after_the_diagonal(p, causal):
    # Note [Foreign pieces first]: forward only; the backward keeps its own blocks first
    plan = plan_of("charm", Layout(2, p), causal, cross_level="q")
    for prog in plan.forward:
        x = prog.cp_rank
        computes = [i for i in prog.instrs if isinstance(i, Compute)]
        assert (computes[0].q_owner, computes[0].kv_owner) == (x, x)
        assert plan.layout.node(computes[1].q_owner) != plan.layout.node(x)
        if p > 1:  # some own partner block still follows the first foreign one
            first_foreign = next(k for k, c in enumerate(computes) if c.q_owner // p != x // p)
            assert any(c.q_owner == x for c in computes[first_foreign:])
    for prog in plan.backward:
        x = prog.cp_rank
        owners = [i.q_owner for i in prog.instrs if isinstance(i, Compute)]
        foreign = [k for k, g in enumerate(owners) if g // p != x // p]
        assert foreign and all(g // p == x // p for g in owners[: foreign[0]])
        assert all(g // p != x // p for g in owners[foreign[0] :])


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backward", [False, True])
def test_two_node_result_receives_are_posted_when_their_turn_comes(p, causal, backward):
    # Note [Receiving results early]: one op per cross.o exchange, and a receive is never
    # held back behind a block: it follows the pass's start or the cross.o exchange before it
    plan = plan_of("charm", Layout(2, p), causal, cross_level="q")
    for prog in plan.programs(backward):
        since_last: list = []  # instructions since the previous cross.o exchange
        for ins in prog.instrs:
            if isinstance(ins, Exchange) and ins.channel == "cross.o":
                assert len(ins.ops) == 1
                if not ins.ops[0].send:
                    assert not any(isinstance(i, Compute) for i in since_last), prog.cp_rank
                since_last = []
            else:
                since_last.append(ins)


@pytest.mark.parametrize("m,p", [(3, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_combined_nodes_run_one_step_a_source_node(m, p, causal):
    # Note [Algorithm 2 per step]: step k runs the queries of the node k + 1 behind (the first
    # also the own ones); the next step's queries cross while the current step computes
    plan = plan_of("charm", Layout(m, p), causal, combine_nodes=True, cross_level="q")
    for prog in (*plan.forward, *plan.backward):

        def step(owner: int, node: int = prog.cp_rank // p) -> int:
            return max((node - owner // p) % m, 1) - 1

        steps = [step(c.q_owner) for c in prog.instrs if isinstance(c, Compute)]
        assert steps == sorted(steps) and set(steps) <= set(range(m - 1)), steps
        computes = [
            (i, step(c.q_owner)) for i, c in enumerate(prog.instrs) if isinstance(c, Compute)
        ]
        for i, ins in enumerate(prog.instrs):
            if isinstance(ins, Exchange) and ins.channel == "cross.q":
                k = max(step(op.payload.owner) for op in ins.ops if not op.send)
                # posted when the step before starts: after its step - 2's blocks, before its own
                assert all(j >= k - 1 for at, j in computes if at > i)
                assert all(j < k - 1 for at, j in computes if at < i), (prog.cp_rank, k)
