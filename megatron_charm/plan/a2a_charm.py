"""All-to-all inside a node, CHARM+'s query parallelism across nodes (``a2a+charm``).

Note [A2a+charm schedule]
~~~~~~~~~~~~~~~~~~~~~~~~~
``a2a+p2p`` (Note [Hierarchical schedule]) splits heads inside a node and runs a kv ring across
nodes. ``a2a+charm`` keeps its all-to-all inside the node and replaces the ring by CHARM+'s
cross-node step: q crosses, kv never does. After the all-to-all, rank ``(a, l)`` holds the q and
kv of node ``a``'s ranks for head group ``l``. For every node offset ``o`` it sends the node's
queries, each restricted to the part that node ``a + o``'s kv can see, to ``(a + o, l)``, and
receives those of node ``a - o`` from ``(a - o, l)``, one exchange per member. It computes its
node's own blocks while the queries travel, then each foreign query against its node's kv, and
sends that partial output (merged over the node's ``p`` kv blocks, so one partial per query and
node) straight back, while it receives its own queries' partials from ``(a + o, l)`` and merges
them. The node's results, complete for head group ``l``, go home inside the node as in
``a2a+p2p``. m = 2, p = 2, rank 1 = (0, 1), causal (node 0's queries need only their second
halves on node 1; node 1's need their whole)::

    forward    intra: post q, kv ->0 (h0) <-0 (h1)                   the all-to-all in node 0
               cross: post q1.second (h1) ->3 <-3 q3 (h1)            one exchange per member,
                      post q0.second (h1) ->3 <-3 q2 (h1)            its own query first
               compute q0, q1 x kv0, kv1 (h1)                         the node's own blocks
               compute q3 x kv0.first, kv1.first -> post o3 ->3 <-3 o1.second (h1)
               compute q2 x kv0.first, kv1.first -> post o2 ->3 <-3 o0.second (h1)
               merge o1.second, o0.second; intra: post o0 ->0 <-0 o1.h0; place o1.h0

    backward   the same with the backward bundle instead of q (without q where the receiver
               kept the forward's: Note [Keeping foreign queries]) and dq instead of o; the
               foreign blocks' dk/dv stay on the node (its kv never left), and dq and dk/dv
               go home inside the node at the end

Cross-node bytes per rank pair and direction, with ``U`` the q of one rank at ``1/p`` of the
heads times ``p`` ranks: ``a2a+p2p`` moves the node's kv, ``2 U / g`` per node step (``g`` the
GQA ratio); ``a2a+charm`` moves the queries and their outputs, ``2 U`` without a mask and
``1.5 U`` causal (one direction carries halves). So its forward moves fewer bytes than
``a2a+p2p``'s only under causal masking with ``g = 1``, by a quarter. Its backward moves dout,
lse and delta out (the queries kept) and dq back, about ``U`` each way (``x 0.75`` causal), where
``a2a+p2p`` moves kv and then the float32 dk/dv around the ring. The head split needs
``h % p == 0`` and ``h_kv % p == 0`` (:func:`megatron_charm.plan.a2a.check_heads` with the node
size).
"""

from __future__ import annotations

from megatron_charm.plan.builder import recv, send
from megatron_charm.plan.hierarchical import NodeRank
from megatron_charm.plan.layout import block_parts
from megatron_charm.plan.types import Kind, Layout, Part, Payload, Program

CROSS_Q, CROSS_O = "cross.q", "cross.o"


def query_part(layout: Layout, q_node: int, kv_node: int, causal: bool) -> Part:
    """The part of every query of ``q_node`` that the kv of ``kv_node`` sees. Under causal
    masking on the zigzag layout (docs/design.md, "Layout of the sequence") that is the
    second half against a later node's kv and the whole query against an earlier node's (whose
    first kv halves it sees); without a mask, the whole."""
    m = layout.num_nodes
    z = layout.rank(q_node % m, 0)
    y = layout.rank(kv_node % m, 0)
    return block_parts(z, y, causal)[0]


class _Cross(NodeRank):
    """One rank of ``a2a+charm``: :class:`NodeRank`'s all-to-all plus the queries' trip across
    nodes."""

    def own_first(self) -> list[int]:
        """Local indices from this rank's own on; its counterparts on other nodes (same local
        index) use the same order, so the exchanges pair up."""
        return [(self.local + k) % self.p for k in range(self.p)]

    def parts(self, o: int) -> tuple[Part, Part]:
        """For node offset ``o``: the part of this node's queries that node ``a + o`` sees, and
        the part of node ``a - o``'s queries that this node sees."""
        out_part = query_part(self.layout, self.node, self.node + o, self.causal)
        return out_part, query_part(self.layout, self.node - o, self.node, self.causal)

    def post_queries(self) -> None:
        """Post every cross-node query exchange: per node offset and member, this node's query
        out, the matching member's of node ``a - o`` in."""
        for o in range(1, self.m):
            out_part, in_part = self.parts(o)
            # this rank's own query first: it needs no all-to-all, so it leaves at once
            for j in self.own_first():
                mine = self.layout.rank(self.node, j)
                theirs = self.layout.rank((self.node - o) % self.m, j)
                self.b.exchange(
                    CROSS_Q,
                    [
                        recv(self.peer(-o), self.q_kind, theirs, in_part, self.heads),
                        send(self.peer(o), self.q_kind, mine, out_part, self.heads),
                    ],
                )

    def foreign(self, kind: Kind) -> None:
        """Each foreign query against the node's kv, its partial sent home at once; this node's
        queries' partials received from the node they went to, and merged."""
        for o in range(1, self.m):
            src_node = (self.node - o) % self.m
            out_part, in_part = self.parts(o)
            for j in self.own_first():
                z = self.layout.rank(src_node, j)
                for y in self.members(self.node):
                    q_part, kv_part, masked = block_parts(z, y, self.causal)
                    assert q_part is in_part or in_part is Part.FULL, (q_part, in_part)
                    self.b.compute(z, y, q_part, kv_part, masked, self.q_kind, self.heads)
                mine = self.layout.rank(self.node, j)
                self.b.exchange(
                    CROSS_O,
                    [
                        recv(self.peer(o), kind, mine, out_part, self.heads, self.p, merged=True),
                        send(self.peer(-o), kind, z, in_part, self.heads, merged=True),
                    ],
                )
        for o in range(1, self.m):  # in the order they were received
            out_part = self.parts(o)[0]
            for j in self.own_first():
                y = self.layout.rank(self.node, j)
                self.b.merge(Payload(kind, y, out_part, self.heads))


def _program(cp_rank: int, layout: Layout, causal: bool, backward: bool) -> Program:
    r = _Cross(cp_rank, layout, causal, Kind.QB if backward else Kind.Q)
    r.gather()
    r.post_queries()
    r.blocks(r.node)
    results = (Kind.DQ, Kind.DKV) if backward else (Kind.O,)
    r.foreign(results[0])
    for kind in results:
        r.give_back(kind)
    for kind in results:
        r.place(kind)
    return r.b.finish()


def a2a_charm_forward(cp_rank: int, layout: Layout, causal: bool) -> Program:
    """Forward program of ``cp_rank`` (Note [A2a+charm schedule])."""
    return _program(cp_rank, layout, causal, backward=False)


def a2a_charm_backward(cp_rank: int, layout: Layout, causal: bool) -> Program:
    """Backward program of ``cp_rank``: the forward's exchanges with the backward bundle and dq
    in place of the output; dk/dv never leave the node until they go home inside it (Note
    [A2a+charm schedule])."""
    return _program(cp_rank, layout, causal, backward=True)
