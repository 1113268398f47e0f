"""How the executor posts a run of exchanges on gloo (Note [Receives of a run first])."""

from __future__ import annotations

from typing import NamedTuple

from megatron_charm.comm.executor import run_batches


class Op(NamedTuple):
    send: bool
    peer: int


def _run(*exchanges: tuple[str, list[int], list[int]]) -> list:
    """``(name, receive peers, send peers)`` per exchange -> staged ``(name, recvs, sends)``."""
    return [
        (name, [Op(False, p) for p in recv], [Op(True, p) for p in send])
        for name, recv, send in exchanges
    ]


def _named(batches) -> list[tuple[str, list[str]]]:
    def arrow(op: Op) -> str:
        return ("->" if op.send else "<-") + str(op.peer)

    return [(name, [arrow(op) for op in ops]) for name, ops in batches]


def test_one_exchange_is_one_batch_receives_first():
    assert _named(run_batches(_run(("A", [3], [1])))) == [("A", ["<-3", "->1"])]


def test_a_run_posts_every_receive_then_every_send_in_program_order():
    # a2a's forward on 4 ranks, rank 0: q and kv to 1, 2, 3; from 3, 2, 1
    staged = _run(("q1", [3], [1]), ("kv1", [3], [1]), ("q2", [2], [2]), ("kv2", [2], [2]))
    staged += _run(("q3", [1], [3]), ("kv3", [1], [3]))
    assert _named(run_batches(staged)) == [
        ("q1", ["<-3"]),
        ("kv1", ["<-3"]),
        ("q2", ["<-2"]),
        ("kv2", ["<-2"]),
        ("q3", ["<-1"]),
        ("kv3", ["<-1"]),
        ("q1", ["->1"]),
        ("kv1", ["->1"]),
        ("q2", ["->2"]),
        ("kv2", ["->2"]),
        ("q3", ["->3"]),
        ("kv3", ["->3"]),
    ]


def test_receives_from_one_peer_keep_their_order():
    # gloo matches a pair's receives to the peer's sends in posting order
    staged = _run(("A", [2, 5], [2]), ("B", [5], [1]), ("C", [2], [5]))
    posted = [(name, op) for name, ops in run_batches(staged) for op in ops]
    for peer in (2, 5):
        got = [name for name, op in posted if not op.send and op.peer == peer]
        assert got == [name for name, recv, _ in staged for op in recv if op.peer == peer]


def test_all_gather_receives_every_peer_before_sending_to_it():
    # offsets 1..7 of 8 ranks, rank 0: send to o, receive from 8 - o
    staged = _run(*((f"o{o}", [8 - o], [o]) for o in range(1, 8)))
    posted = [op for _, ops in run_batches(staged) for op in ops]
    assert sorted(posted) == sorted(op for _, r, s in staged for op in r + s)
    assert posted == [Op(False, 8 - o) for o in range(1, 8)] + [Op(True, o) for o in range(1, 8)]


def test_empty_parts_post_nothing():
    staged = _run(("A", [], [1]), ("B", [3], []))
    assert _named(run_batches(staged)) == [("B", ["<-3"]), ("A", ["->1"])]


def test_a_run_goes_on_while_another_exchange_follows():
    # the runner and the replay stage an exchange while the run goes on: a2a's forward posts
    # its six inputs (q and kv to each of three peers) back to back, then computes
    from megatron_charm.plan.a2a import a2a_forward
    from megatron_charm.plan.coalesce import run_goes_on
    from megatron_charm.plan.types import Exchange

    instrs = a2a_forward(0, 4, causal=True).instrs
    going_on = [i for i in range(len(instrs)) if run_goes_on(instrs, i)]
    assert going_on == [0, 1, 2, 3, 4]
    assert isinstance(instrs[5], Exchange) and not isinstance(instrs[6], Exchange)
    assert not run_goes_on(instrs, len(instrs) - 1)
