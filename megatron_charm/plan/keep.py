"""Foreign queries kept from the forward to the backward (pure; no torch).

Note [Keeping foreign queries]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With q crossing nodes, rank ``y`` receives the q pieces of its counterpart ``x`` on another node
in the forward, and the same pieces again in the backward, inside ``x``'s bundle (q, dout, lse,
delta). The backward cross level ``dout`` has ``y`` keep the forward's pieces, so that the
bundle crossing nodes carries dout, lse and delta only (:attr:`Kind.DB`): with multi-head
attention, half of its bytes::

    forward    x --q.first--> y    x --q.second--> y      y keeps both pieces
    backward   x --db.first--> y   (y: bundle = kept q.first + db.first)
               x --db.second--> y  (y: bundle = kept q.second + db.second)

A rank decides from its own two programs, so no rank needs another's: a bundle op (send or
receive) of the backward with a peer on another node becomes a ``DB`` op when the forward moved
the same q piece (owner, part, heads) between the same two ranks in the same direction, once in
each pass. Sender and receiver see the same forward transfer, so they agree.

The price is memory: a kept piece lives from its forward receive to its backward receive
(:mod:`megatron_charm.plan.memory` counts it in both passes and between them), and
``PlanOptions.foreign_q="auto"`` keeps unless that takes the attention memory above both
``memory_budget`` and what resending holds (:func:`megatron_charm.plan.keeps_foreign_q`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from megatron_charm.plan.types import Exchange, Kind, Layout, Payload, Program

Move = tuple[bool, int, Payload]  # (send, peer cp_rank, q piece as a Kind.Q payload)


def q_piece(p: Payload) -> Payload:
    """The q piece (a ``Kind.Q`` payload) that a bundle payload ``p`` (``QB`` or ``DB``) is of."""
    return Payload(Kind.Q, p.owner, p.part, p.heads)


def _cross_moves(prog: Program, layout: Layout, kind: Kind) -> Counter[Move]:
    node = layout.node(prog.cp_rank)
    return Counter(
        (op.send, op.peer, q_piece(op.payload))
        for ex in prog.exchanges()
        for op in ex.ops
        if op.payload.kind is kind and layout.node(op.peer) != node
    )


def keep_foreign_q(forward: Program, backward: Program, layout: Layout) -> Program:
    """``backward`` with its cross-node bundles of forward-moved q pieces shipped as ``DB``
    (Note [Keeping foreign queries]); both programs of one rank, ``layout``: the CP group's."""
    fwd = _cross_moves(forward, layout, Kind.Q)
    bwd = _cross_moves(backward, layout, Kind.QB)
    keep = {m for m, n in bwd.items() if n == 1 and fwd.get(m) == 1}
    if not keep:
        return backward
    node = layout.node(backward.cp_rank)
    instrs = []
    for ins in backward.instrs:
        if isinstance(ins, Exchange):
            ops = tuple(
                replace(op, payload=replace(op.payload, kind=Kind.DB))
                if op.payload.kind is Kind.QB
                and layout.node(op.peer) != node
                and (op.send, op.peer, q_piece(op.payload)) in keep
                else op
                for op in ins.ops
            )
            ins = replace(ins, ops=ops)
        instrs.append(ins)
    return replace(backward, instrs=tuple(instrs))


def kept_pieces(backward: Program) -> frozenset[Payload]:
    """The q pieces (``Kind.Q`` payloads) that a rank keeps from its forward for ``backward``:
    one for each ``DB`` it receives."""
    return frozenset(
        q_piece(op.payload)
        for ex in backward.exchanges()
        for op in ex.ops
        if not op.send and op.payload.kind is Kind.DB
    )


def held_input(kind: Kind) -> Kind:
    """The input kind a payload of ``kind`` becomes, or is taken from, on a rank: a ``DB``
    completes (and is cut from) the backward bundle ``QB``."""
    return Kind.QB if kind is Kind.DB else kind
