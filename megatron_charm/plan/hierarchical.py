"""Hierarchical context parallelism (``a2a+p2p``), as Transformer Engine runs it on Megatron's
``hierarchical_context_parallel_sizes``: all-to-all inside a node, a ring across nodes.

Note [Hierarchical schedule]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On ``m`` nodes of ``p`` ranks, rank ``x = (a, l)`` (node ``a``, local index ``l``) first runs the
all-to-all of Note [All-to-all schedule] inside its node: it gathers the q and kv of the node's
ranks ``N(a)`` for head group ``l`` of ``p``. The node then acts as one ring member holding
``p`` ranks' tokens, and the ranks of one local index run a ring across nodes (on the ``cross``
channels, one rail each): at step ``s`` rank ``(a, l)`` computes the node's queries against the
kv of node ``a - s`` (``p x p`` zigzag blocks of ``1/p`` of the heads), while that kv is sent on
to ``(a + 1, l)`` and the kv of node ``a - s - 1`` comes in. As in the ring (Note [Ring
schedule]) forwarded kv is whole. After the last step every result of the node's queries for
head group ``l`` is complete and goes back to its owner inside the node, where it is placed into
its head slice. m = 2, p = 2, rank 1 = (0, 1), head group 1 (``h1``)::

    forward    intra: post q, kv ->0 (h0) <-0 (h1)               the all-to-all in node 0
               cross: post kv0, kv1 (h1) ->3 <-3 kv2, kv3 (h1)    the ring step to node 1
               compute q0, q1 x kv0, kv1 (h1); then x kv2, kv3 as they arrive
               intra: post o0.h1 ->0 <-0 o1.h0; place o1.h0

    backward   the bundle instead of q; after each step the node's partial dk/dv of that step's
               kv go on to the next node (float32 once merged), one step behind the kv, and the
               last hop brings each node's own dk/dv home complete; then dq and dk/dv go back to
               their owners inside the node

Cross-node bytes per rank and step: the kv of ``p`` ranks at ``1/p`` of the kv heads, the bytes of
one whole kv, as a ring rank sends, but ``m - 1`` steps instead of ``n - 1``. The head split needs
``h % p == 0`` and ``h_kv % p == 0`` (:func:`check_heads` with the node size).
"""

from __future__ import annotations

from megatron_charm.plan.builder import ProgramBuilder, recv, send
from megatron_charm.plan.layout import block_parts
from megatron_charm.plan.types import Heads, Kind, Layout, Part, Payload, Program

INTRA_Q, INTRA_KV, INTRA_O = "intra.q", "intra.kv", "intra.o"
CROSS_KV, CROSS_O = "cross.kv", "cross.o"


class NodeRank:
    """One rank's view: its node, local index, head group and neighbours (shared with
    ``a2a+charm``, Note [A2a+charm schedule])."""

    def __init__(self, cp_rank: int, layout: Layout, causal: bool, q_kind: Kind) -> None:
        self.b = ProgramBuilder(cp_rank)
        self.layout, self.causal, self.q_kind = layout, causal, q_kind
        self.node, self.local = layout.node(cp_rank), layout.local(cp_rank)
        self.p, self.m = layout.ranks_per_node, layout.num_nodes
        self.heads = Heads(self.local, self.p)

    def members(self, node: int) -> list[int]:
        return [self.layout.rank(node % self.m, j) for j in range(self.p)]

    def peer(self, node_step: int, local_step: int = 0) -> int:
        return self.layout.rank(
            (self.node + node_step) % self.m, (self.local + local_step) % self.p
        )

    def gather(self) -> None:
        """The all-to-all inside the node (q, then kv, per offset)."""
        x = self.b.cp_rank
        for o in range(1, self.p):
            dst, src = self.peer(0, o), self.peer(0, -o)
            theirs = Heads(self.layout.local(dst), self.p)
            for kind, channel in ((self.q_kind, INTRA_Q), (Kind.KV, INTRA_KV)):
                self.b.exchange(
                    channel,
                    [
                        send(dst, kind, x, Part.FULL, theirs),
                        recv(src, kind, src, Part.FULL, self.heads),
                    ],
                )

    def shift(self, kind: Kind, channel: str, step: int) -> None:
        """Ring step ``step``: send ``kind`` of node ``a - step``'s ranks on to the next node;
        receive node ``a - step - 1``'s from the previous one."""
        ops = [
            send(self.peer(1), kind, y, Part.FULL, self.heads)
            for y in self.members(self.node - step)
        ]
        # a partial dk/dv holds the sending node's p blocks at step 0, merged ones after
        held = (self.p if step == 0 else 2) if kind.is_partial else 0
        ops += [
            recv(self.peer(-1), kind, y, Part.FULL, self.heads, held=held)
            for y in self.members(self.node - step - 1)
        ]
        self.b.exchange(channel, ops)

    def blocks(self, kv_node: int) -> None:
        """The node's queries against the kv of ``kv_node``'s ranks, on this head group."""
        for y in self.members(kv_node):
            for z in self.members(self.node):
                parts = block_parts(z, y, self.causal)
                self.b.compute(z, y, *parts, q_kind=self.q_kind, heads=self.heads)

    def give_back(self, kind: Kind) -> None:
        """Send each node member's complete ``kind`` of this head group home; place the ones
        returned to this rank."""
        x = self.b.cp_rank
        for o in range(1, self.p):
            dst, src = self.peer(0, o), self.peer(0, -o)
            self.b.exchange(
                INTRA_O,
                [
                    send(dst, kind, dst, Part.FULL, self.heads),
                    recv(src, kind, x, Part.FULL, Heads(self.layout.local(src), self.p)),
                ],
            )

    def place(self, kind: Kind) -> None:
        x = self.b.cp_rank
        for o in range(1, self.p):
            group = Heads(self.layout.local(self.peer(0, -o)), self.p)
            self.b.merge(Payload(kind, x, Part.FULL, group))


def hierarchical_forward(cp_rank: int, layout: Layout, causal: bool) -> Program:
    """Forward program of ``cp_rank`` (Note [Hierarchical schedule])."""
    r = NodeRank(cp_rank, layout, causal, Kind.Q)
    r.gather()
    for step in range(r.m):
        if step + 1 < r.m:
            r.shift(Kind.KV, CROSS_KV, step)
        r.blocks(r.node - step)
    r.give_back(Kind.O)
    r.place(Kind.O)
    return r.b.finish()


def hierarchical_backward(cp_rank: int, layout: Layout, causal: bool) -> Program:
    """Backward program of ``cp_rank``: the forward's exchanges with the backward bundle, the
    partial dk/dv of every node step sent on along the ring, then dq and dk/dv home inside the
    node (Note [Hierarchical schedule])."""
    r = NodeRank(cp_rank, layout, causal, Kind.QB)
    r.gather()
    for step in range(r.m):
        if step + 1 < r.m:
            r.shift(Kind.KV, CROSS_KV, step)
        r.blocks(r.node - step)
        if r.m == 1:
            break
        if step > 0:  # the partials of this kv from the nodes before, one step behind
            for y in r.members(r.node - step):
                r.b.merge(Payload(Kind.DKV, y, Part.FULL, r.heads))
        r.shift(Kind.DKV, CROSS_O, step)
    if r.m > 1:  # this node's own dk/dv, complete after the last hop
        for y in r.members(r.node):
            r.b.merge(Payload(Kind.DKV, y, Part.FULL, r.heads))
    r.give_back(Kind.DQ)
    r.give_back(Kind.DKV)
    r.place(Kind.DQ)
    r.place(Kind.DKV)
    return r.b.finish()
