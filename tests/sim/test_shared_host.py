"""The shared host's processor-sharing queue (Note [Virtual time on the host] in
megatron_charm/sim/shared_host.py) and the replay that runs on it."""

from __future__ import annotations

import pytest

from megatron_charm.plan import Layout, PlanOptions
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Part, Program
from megatron_charm.sim.compute import FittedCompute
from megatron_charm.sim.engine import simulate_pass
from megatron_charm.sim.programs import ProgramSet
from megatron_charm.sim.shared_host import SharedHost
from megatron_charm.sim.topology import Topology


def _drain(host: SharedHost, starts: dict[float, list[tuple[float, str]]]) -> dict[str, float]:
    """Run ``host`` with flows ``(work, name)`` starting at the given times; their ends."""
    ends: dict[str, float] = {}
    pending = sorted(starts.items())
    now = 0.0
    while pending or len(host):
        nxt = host.next_end(now)
        if pending and (nxt is None or pending[0][0] <= nxt):
            now, flows = pending.pop(0)
            for work, name in flows:
                host.add(work, name, now)
        else:
            now = nxt
            ends[host.pop(now)] = now
    return ends


def test_the_notes_example() -> None:
    # capacity 1: a (4 s) alone at full speed until b (1 s) starts at 2; both at half speed
    # until b ends at 4; a alone again for its last 1 s
    ends = _drain(SharedHost(1.0), {0.0: [(4.0, "a")], 2.0: [(1.0, "b")]})
    assert ends == pytest.approx({"b": 4.0, "a": 5.0})


@pytest.mark.parametrize(
    ("capacity", "want"),
    [
        # three flows of 3 s on two slots: 2/3 speed each, all end at 4.5
        (2.0, {"x": 4.5, "y": 4.5, "z": 4.5}),
        # on four slots each runs alone at full speed (never above it)
        (4.0, {"x": 3.0, "y": 3.0, "z": 3.0}),
        # on one slot: a third of the speed each
        (1.0, {"x": 9.0, "y": 9.0, "z": 9.0}),
    ],
)
def test_equal_flows_share_the_slots_up_to_full_speed(capacity, want) -> None:
    ends = _drain(SharedHost(capacity), {0.0: [(3.0, "x"), (3.0, "y"), (3.0, "z")]})
    assert ends == pytest.approx(want)


def test_a_short_flow_that_starts_late_ends_first() -> None:
    # two slots: a and b (5 s each) at full speed; c (1 s) joins at 1 and all three run at
    # 2/3 until c ends at 2.5; a and b, with 3 s left each, at full speed again: 5.5
    ends = _drain(SharedHost(2.0), {0.0: [(5.0, "a"), (5.0, "b")], 1.0: [(1.0, "c")]})
    assert ends == pytest.approx({"c": 2.5, "a": 5.5, "b": 5.5})
    assert list(ends) == ["c", "a", "b"]  # ties end in the order they started


def test_the_next_end_moves_with_every_start() -> None:
    host = SharedHost(1.0)
    host.add(2.0, "a", 0.0)
    before = host.version
    assert host.next_end(0.0) == pytest.approx(2.0)
    host.add(2.0, "b", 1.0)  # a has 1 s left, now at half speed
    assert host.version != before
    assert host.next_end(1.0) == pytest.approx(3.0)
    assert host.pop(3.0) == "a"
    assert host.next_end(3.0) == pytest.approx(4.0)


def test_the_replay_shares_the_host_between_blocks_of_unequal_runs() -> None:
    # cp_rank r computes r + 1 blocks of 1 ms alone, one after the other, four ranks on two
    # slots: all at half speed until 2 ms (rank 0 done), three at 2/3 until 3.5 (rank 1), then
    # two and one at full speed: ranks end at 2, 3.5, 4.5, 5.5 ms
    shape = AttnShape(b=1, s_local=64, h=1, h_kv=1, d=64)
    flops = 4.0 * 64 * 64 * 64
    compute = FittedCompute(flops / 1e-3, flops / 1e-3, shared_slots=2.0)
    block = Compute(0, 0, Part.FULL, Part.FULL, False)
    progs = tuple(Program(r, (block,) * (r + 1)) for r in range(4))
    sets = ProgramSet(PlanOptions(method="ring"), Layout(1, 4), False, progs, progs, "none")
    topo = Topology(num_nodes=1, ranks_per_node=4, intra_bw=1e9, cross_bw=1e9)
    res = simulate_pass(sets, topo, shape, compute, False)
    finish = {r.cp_rank: r.finish for r in res.ranks}
    assert finish == pytest.approx({0: 2e-3, 1: 3.5e-3, 2: 4.5e-3, 3: 5.5e-3}, rel=1e-9)
    # the work it charged the host: ten blocks of 1 ms alone, whatever the sharing
    assert res.host_work == pytest.approx(10e-3, rel=1e-9)
    alone = FittedCompute(flops / 1e-3, flops / 1e-3)  # each rank on its own device
    assert simulate_pass(sets, topo, shape, alone, False).host_work == 0.0
