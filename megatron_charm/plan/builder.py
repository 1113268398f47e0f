"""Program builder: appends instructions and inserts each ``Wait`` right before first use.

The schedule generators describe *what* moves and *what* is computed; the builder tracks which
received payloads are still in flight and waits for them lazily, so a compute blocks only on its
own inputs. Every exchange is waited for by the end of the program.
"""

from __future__ import annotations

from megatron_charm.plan.types import (
    Compute,
    Exchange,
    Heads,
    Instr,
    Kind,
    Merge,
    Op,
    Part,
    Payload,
    Program,
    Wait,
)


class ProgramBuilder:
    def __init__(self, cp_rank: int) -> None:
        self.cp_rank = cp_rank
        self.instrs: list[Instr] = []
        self._next_handle = 0
        self._unwaited: dict[int, None] = {}  # insertion-ordered set
        # (kind, owner, heads) -> receives not yet waited for (part, handle, peer), oldest
        # first. Several can be in flight: partials come from several senders, and kv is
        # fetched again in every CHARM+ round.
        self._inflight: dict[tuple[Kind, int, Heads | None], list[tuple[Part, int, int]]] = {}

    def exchange(self, channel: str, ops: list[Op]) -> int:
        if not ops:
            raise AssertionError("empty exchange")
        for op in ops:
            if op.send and not op.payload.kind.is_partial and op.payload.owner != self.cp_rank:
                self.need(op.payload)
        handle = self._next_handle
        self._next_handle += 1
        self.instrs.append(Exchange(handle, channel, tuple(ops)))
        self._unwaited[handle] = None
        for op in ops:
            if not op.send:
                key = (op.payload.kind, op.payload.owner, op.payload.heads)
                self._inflight.setdefault(key, []).append((op.payload.part, handle, op.peer))
        return handle

    def wait(self, handle: int) -> None:
        if handle in self._unwaited:
            del self._unwaited[handle]
            self.instrs.append(Wait(handle))

    def need(self, payload: Payload) -> tuple[int, int] | None:
        """Wait for the oldest in-flight receive that delivers ``payload``; return its handle and
        the CP rank it comes from.

        ``None`` means nothing is in flight for it: the rank owns it or received it earlier.
        """
        pending = self._inflight.get((payload.kind, payload.owner, payload.heads), [])
        for idx, (part, handle, peer) in enumerate(pending):
            if part.contains(payload.part):
                self.wait(handle)
                pending.pop(idx)
                return handle, peer
        return None

    def compute(
        self,
        q_owner: int,
        kv_owner: int,
        q_part: Part,
        kv_part: Part,
        masked: bool,
        q_kind: Kind = Kind.Q,
        heads: Heads | None = None,
    ) -> None:
        if q_owner != self.cp_rank:
            self.need(Payload(q_kind, q_owner, q_part, heads))
        if kv_owner != self.cp_rank:
            self.need(Payload(Kind.KV, kv_owner, kv_part, heads))
        self.instrs.append(Compute(q_owner, kv_owner, q_part, kv_part, masked, heads))

    def merge(self, payload: Payload) -> None:
        """Fold the received partial ``payload`` into this rank's accumulator."""
        got = self.need(payload)
        if got is None:
            raise AssertionError(f"rank {self.cp_rank} merges {payload} that was never received")
        self.instrs.append(Merge(payload, *got))

    def finish(self) -> Program:
        for handle in list(self._unwaited):
            self.wait(handle)
        return Program(self.cp_rank, tuple(self.instrs))


def send(
    peer: int,
    kind: Kind,
    owner: int,
    part: Part,
    heads: Heads | None = None,
    merged: bool = False,
) -> Op:
    """A send; ``merged``: see :attr:`megatron_charm.plan.types.Op.merged`."""
    return Op(True, peer, Payload(kind, owner, part, heads), merged=merged)


def recv(
    peer: int,
    kind: Kind,
    owner: int,
    part: Part,
    heads: Heads | None = None,
    held: int = 0,
    merged: bool = False,
) -> Op:
    """A receive; ``held``: for a partial, the blocks in the sender's accumulator;
    ``merged``: see :attr:`megatron_charm.plan.types.Op.merged`."""
    return Op(False, peer, Payload(kind, owner, part, heads), held=held, merged=merged)
