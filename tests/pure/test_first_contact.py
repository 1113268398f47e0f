"""NCCL's lazy connections (Note [First contact], Note [Warm-up]) and the channel groups' timeout.

The replay can model a first send/recv that blocks until the peer arrives; plans are not ordered
for that (many would hang), so the topology connects every pair of every channel group at build.
These tests show the model catches a cycle of first contacts, that real plans need the warm-up,
and that the warm-up covers every pair any plan uses.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from megatron_charm.comm import topology
from megatron_charm.comm.topology import channel_groups, warm_pairs
from megatron_charm.plan import CHANNELS, METHODS, Layout, PlanOptions, build_plan
from megatron_charm.plan.types import (
    Compute,
    Exchange,
    Kind,
    Op,
    Part,
    Payload,
    Plan,
    Program,
    Wait,
)
from megatron_charm.plan.validate import ScheduleError, replay, validate

SPLITS = [(n, p) for n in range(1, 13) for p in range(1, n + 1) if n % p == 0]


def _plans(n: int, p: int):
    for method in METHODS:
        if method not in ("charm", "a2a+p2p") and p != n:
            continue
        if method in ("a2a", "a2a+p2p") and n > 8:
            continue  # n**3 blocks per pass, one exchange pattern: smaller sizes cover it
        combos = [False, True] if method == "charm" and n // p >= 2 else [False]
        for combine in combos:
            levels = ["q", "kv"] if method == "charm" and n // p > 1 and not combine else ["q"]
            for level in levels:
                for causal in (True, False):
                    options = PlanOptions(method=method, combine_nodes=combine, cross_level=level)
                    yield build_plan(options, Layout(n // p, p), causal)


def _kv_swap_plan(first_channel: dict[int, str]) -> Plan:
    """Two ranks, full attention: each fetches the other's kv in two halves, one half per
    channel; ``first_channel[x]`` is the channel rank ``x`` posts first."""
    progs = []
    for x, y in ((0, 1), (1, 0)):
        first = first_channel[x]
        second = "full.q" if first == "full.kv" else "full.kv"
        half = {"full.kv": Part.FIRST, "full.q": Part.SECOND}
        instrs: list = [Compute(x, x, Part.FULL, Part.FULL, False)]
        for handle, channel in enumerate((first, second)):
            part = half[channel]
            ops = (Op(True, y, Payload(Kind.KV, x, part)), Op(False, y, Payload(Kind.KV, y, part)))
            instrs.insert(handle, Exchange(handle, channel, ops))
        for handle, channel in enumerate((first, second)):
            instrs += [Wait(handle), Compute(x, y, Part.FULL, half[channel], False)]
        progs.append(Program(x, tuple(instrs)))
    channels = (("full.kv", "full"), ("full.q", "full"))
    return Plan(PlanOptions(method="merge"), Layout(1, 2), False, tuple(progs), (), channels)


def test_model_catches_a_cycle_of_first_contacts():
    # gloo semantics: both exchanges are posted, both complete
    crossed = _kv_swap_plan({0: "full.kv", 1: "full.q"})
    replay(crossed)
    # NCCL without warm-up: rank 0 waits for 1 on full.kv, rank 1 for 0 on full.q
    with pytest.raises(ScheduleError, match="first exchange with cp_rank.s. \\[1\\] on full.kv"):
        replay(crossed, first_contact_blocks=True)
    # the same plan with both first contacts in one order does not hang
    replay(_kv_swap_plan({0: "full.kv", 1: "full.kv"}), first_contact_blocks=True)
    # and with the warm-up's connections it cannot block at all
    replay(crossed, first_contact_blocks=True, connected=warm_pairs(Layout(1, 2)))


def test_real_plans_need_the_warm_up():
    plan = build_plan(PlanOptions(method="merge"), Layout(1, 5), True)
    with pytest.raises(ScheduleError, match="first exchange"):
        validate(plan, first_contact_blocks=True)
    validate(plan, first_contact_blocks=True, connected=warm_pairs(plan.layout))


@pytest.mark.parametrize("n,p", SPLITS, ids=[f"{n // p}x{p}" for n, p in SPLITS])
def test_warm_up_covers_every_pair_every_plan_uses(n, p):
    pairs = warm_pairs(Layout(n // p, p))
    for plan in _plans(n, p):
        for progs in (plan.forward, plan.backward):
            for prog in progs:
                for ins in prog.instrs:
                    if isinstance(ins, Exchange):
                        for op in ins.ops:
                            a, b = sorted((prog.cp_rank, op.peer))
                            assert (ins.channel, a, b) in pairs, (plan.method, ins, prog.cp_rank)


def test_channel_groups_partition_the_ranks():
    layout = Layout(3, 2)
    groups = channel_groups(layout)
    assert set(groups) == set(CHANNELS)
    assert groups["cross.q"] == [(0, 2, 4), (1, 3, 5)]
    assert groups["intra.kv"] == [(0, 1), (2, 3), (4, 5)]
    assert groups["full.o"] == [tuple(range(6))]
    assert channel_groups(Layout(1, 3))["intra.q"] == [(0, 1, 2)]
    assert "cross.q" not in channel_groups(Layout(1, 3))


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_every_channel_group_gets_the_timeout(monkeypatch, backend):
    made = []

    def new_group(members, timeout=None, backend=None):
        made.append((tuple(members), timeout, backend))
        return object()

    monkeypatch.setattr(topology.dist, "new_group", new_group)
    monkeypatch.setattr(topology.dist, "get_rank", lambda: 13)
    ranks = [10, 11, 12, 13, 14, 15]  # global ranks of a CP group of 3 nodes x 2
    timeout = timedelta(seconds=77)
    mine = topology._make_channel_groups(ranks, 2, backend, timeout)
    assert {(t, be) for _, t, be in made} == {(timeout, backend)}
    want = [
        tuple(ranks[x] for x in members)
        for groups in channel_groups(Layout(3, 2)).values()
        for members in groups
    ]
    assert [m for m, _, _ in made] == want
    assert set(mine) == set(CHANNELS)
