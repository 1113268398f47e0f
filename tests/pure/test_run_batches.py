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


def test_receives_from_a_peer_go_before_the_first_send_to_it():
    # a2a's forward on 4 ranks, rank 0: q and kv to 1, 2, 3; from 3, 2, 1
    staged = _run(("q1", [3], [1]), ("kv1", [3], [1]), ("q2", [2], [2]), ("kv2", [2], [2]))
    staged += _run(("q3", [1], [3]), ("kv3", [1], [3]))
    assert _named(run_batches(staged)) == [
        ("q3", ["<-1"]),
        ("kv3", ["<-1"]),
        ("q1", ["<-3", "->1"]),
        ("kv1", ["<-3", "->1"]),
        ("kv2", ["<-2"]),  # q2 sends to 2 before kv2 would receive from it
        ("q2", ["<-2", "->2"]),
        ("kv2", ["->2"]),
        ("q3", ["->3"]),
        ("kv3", ["->3"]),
    ]


def test_all_gather_receives_every_peer_before_sending_to_it():
    # offsets 1..7 of 8 ranks, rank 0: send to o, receive from 8 - o
    staged = _run(*((f"o{o}", [8 - o], [o]) for o in range(1, 8)))
    posted = [op for _, ops in run_batches(staged) for op in ops]
    assert sorted(posted) == sorted(op for _, r, s in staged for op in r + s)
    for i, op in enumerate(posted):
        if op.send:  # the receive from that peer came before
            assert Op(False, op.peer) in posted[:i], op
    # the sends keep the program's order, and nothing is hoisted that need not be
    assert [op.peer for op in posted if op.send] == list(range(1, 8))
    assert [n for n, ops in run_batches(staged) if not ops[-1].send] == ["o7", "o6", "o5"]


def test_a_run_without_shared_peers_keeps_the_program_order():
    # ring-like: send to the next rank, receive from the one before, in every exchange
    staged = _run(("A", [3], [1]), ("B", [3], [1]))
    assert _named(run_batches(staged)) == [("A", ["<-3", "->1"]), ("B", ["<-3", "->1"])]
