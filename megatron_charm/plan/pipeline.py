"""Merge, RM+ and CHARM+ schedules: direct fetches in log-depth levels, q and kv on two channels,
and query sets shipped across nodes so that kv never leaves its node.

Note [CHARM+ rounds]
~~~~~~~~~~~~~~~~~~~~
With ``m`` nodes of ``p`` ranks, rank ``(a, l)`` (node ``a``, local index ``l``) sends its q once to
``(a + o, l)`` for every offset ``o = 1..m-1`` and receives the q of ``(a - o, l)``. Each node runs
its intra-node RM+ pipeline (see :mod:`megatron_charm.plan.partners`) over *query sets*: a q owner
and the part of its local sequence that the round covers.

A foreign q that a node needs whole travels as two halves (two cross transfers) and is processed
in two rounds, so the first half is computed, and its output is on its way back, while the second
half still crosses (the second leaves when the first has arrived: Note [Chained cross pieces]).
The next offset's q travels while the current one computes::

    node a        round 0        round 1            round 2            round 3 ...
    cross q     -- q(a-1).first -- q(a-1).second --- q(a-2) ...
    intra       RM+ own q      RM+ q(a-1).first   RM+ q(a-1).second  ...
    cross out                  out(a-1).first --- out(a-1).second -----------> (last exposed)

``combine_nodes`` gives the paper's Algorithm 2 instead (Note [Algorithm 2 per step]): every q
crosses whole, the first round runs the node's own query set with the first foreign one, and the
foreign q must arrive before the round's q exchanges start. Fewer operations per rank (one
intra-node pipeline a source node instead of two a foreign node, and one for the own), less
overlap of the cross transfers.

Note [Algorithm 2 per step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
On two nodes Algorithm 2 is one step: ``CrossComm(q)``, ``Commwait``, one intra-node pipeline over
the own and the crossed queries, the crossed queries' outputs back at the end. The paper's
Appendix C.2 says how it runs on more: "the only dependency is that cross-node query
communication must finish before the intra-node pipeline begins. Accordingly, the query required
for the next step can be communicated concurrently during the intra-node pipeline." So on ``m``
nodes there are ``m - 1`` steps, one a source node, the first also running the own queries; a
step's pipeline hides the next step's queries crossing and the last step's outputs going back::

    node a       step 0                    step 1              step 2 (m = 4)
    cross q      q(a-1) | q(a-2) ------------ | q(a-3) ----------- |
    intra               | RM+ own + q(a-1)    | RM+ q(a-2)         | RM+ q(a-3)
    cross out                                 | out(a-1) --------- | out(a-2) --- | out(a-3)

Rounds ``[[own, (1, 0)], [(2, 0)], ..., [(m - 1, 0)]]``; the next step's queries are posted when a
round starts (:meth:`_Pass.run_round`). Until 2026-12-05 one round ran every node's queries, so on
four nodes all three foreign query sets crossed before the first level (the simulator's replay of
the paper's 4 x 8 CHARM+ was 5-12% slower than its Table 5 rows; per step, within 9%).

The rank that ran a foreign query set returns its merged (out, lse), and the owner merges it. The
backward mirrors this: the foreign rank receives (q, dout, lse, delta), runs the same pipeline,
keeps dk/dv at home and returns dq.

Inside a round, rank ``x`` prefetches ``window`` exchanges per channel ahead of its computation and
computes each block as soon as its own inputs arrived; a partner's kv that an earlier round brought
is kept and reused when it covers what the round needs; q-exchange blocks come first in a level so
their outputs start travelling back early (paper Appendix A).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from megatron_charm.plan.builder import ProgramBuilder, recv, send
from megatron_charm.plan.layout import block_parts
from megatron_charm.plan.partners import PartnerTask, partner_tasks
from megatron_charm.plan.types import Kind, Layout, Op, Part, Payload, Program

#: Partner tasks between receiving a partner's partial and merging it (Note [Merging a round
#: late], where the trade-off is measured).
MERGE_LAG = 1

QSet = tuple[int, Part]  # (q owner, part of its local sequence that a round covers)
KVSet = tuple[int, Part]  # (kv owner, part) that a rank hosts in a round
Slot = tuple[int, int]  # (node offset, piece index): one foreign piece of a round


class CrossRoute(NamedTuple):
    """Where this rank's q goes, and whose q comes in, at one node offset."""

    dst: int
    """The rank that computes this rank's q (same local index, ``offset`` nodes ahead)."""
    src: int
    """The rank whose q this rank computes (``offset`` nodes behind)."""
    mine: tuple[Part, ...]
    """Pieces in which this rank's q travels to ``dst``."""
    theirs: tuple[Part, ...]
    """Pieces in which ``src``'s q arrives here."""


@dataclass(frozen=True)
class PipelineConfig:
    split: bool
    """RM+ q/kv split (False: the plain merge mechanism, kv only)."""
    scope: str
    """Channel scope of the intra-node pipeline: ``"intra"`` or ``"full"``."""
    window: int = 2
    """Exchanges in flight per channel."""
    combine_nodes: bool = False
    """The paper's Algorithm 2, one round a source node, the first with the own q (Note
    [Algorithm 2 per step]; cross ``q`` only)."""
    split_foreign: bool = True
    """Ship a foreign q that is needed whole as two halves, processed in two rounds."""
    cross: str = "q"
    """What crosses nodes: ``"q"`` (CHARM+: q goes out, results come back) or ``"kv"`` (each kv
    crosses once to its counterpart and is shared inside the node; see Note [Cross level])."""


@functools.lru_cache(maxsize=16)
def _shared_memo(layout: Layout, causal: bool, cfg: PipelineConfig) -> dict[tuple, object]:
    """The memo of :class:`_Pass`'s pure lookups (pieces, query and kv sets, blocks) for one
    layout, mask rule and config; a whole plan asks each of them once per rank."""
    return {}


def algorithm2_step(offset: int) -> int:
    """The round in which ``combine_nodes`` runs the queries of the node ``offset`` nodes behind
    (0: the node's own), Note [Algorithm 2 per step]: the own with the first source node's, then
    one source node a round."""
    return max(offset, 1) - 1


def foreign_q_part(q_owner: int, node: int, layout: Layout, causal: bool) -> Part:
    """Part of q of ``q_owner`` that node ``node``'s kv can see (union over the node's ranks)."""
    first, last = layout.rank(node, 0), layout.rank(node, layout.ranks_per_node - 1)
    if first <= q_owner <= last:
        return Part.FULL
    # every rank of another node is on the same side of q_owner, so one block decides
    return block_parts(q_owner, first, causal)[0]


def foreign_kv_part(kv_owner: int, node: int, layout: Layout, causal: bool) -> Part:
    """Part of kv of ``kv_owner`` that node ``node``'s queries see (union over the node)."""
    first, last = layout.rank(node, 0), layout.rank(node, layout.ranks_per_node - 1)
    if first <= kv_owner <= last:
        return Part.FULL
    return block_parts(first, kv_owner, causal)[1]


def restrict(block_q: Part, piece: Part) -> Part | None:
    """The q part of a block limited to a query set's piece; ``None`` if they do not overlap."""
    if piece == Part.FULL or block_q == piece:
        return block_q
    if block_q == Part.FULL:
        return piece
    return None


class _Pass:
    """Builds one rank's program for one pass (forward or backward).

    In every round each rank hosts some *query sets* (q owner, piece) and exactly one *kv set*
    (kv owner, part): with ``cross="q"`` its own kv and, after round 0, foreign query sets; with
    ``cross="kv"`` its own q and, after round 0, the kv of its counterpart on another node. The
    intra-node RM+ pipeline then computes every hosted query set against every hosted kv set of
    the node, exactly once.
    """

    def __init__(self, cp_rank: int, layout: Layout, causal: bool, cfg: PipelineConfig, bwd: bool):
        self.x = cp_rank
        self.layout = layout
        self.causal = causal
        self.cfg = cfg
        self.bwd = bwd
        self.b = ProgramBuilder(cp_rank)
        self.qkind = Kind.QB if bwd else Kind.Q
        self.result_kind = Kind.DQ if bwd else Kind.O  # what a q exchange returns
        self.channel = {c: f"{cfg.scope}.{c}" for c in ("kv", "q", "o")}
        self.kv_cross = cfg.cross == "kv" and layout.num_nodes > 1
        self.combined = cfg.combine_nodes and layout.num_nodes >= 2 and not self.kv_cross
        # kv kept across rounds: kv owner -> part held here; (peer, kv owner) -> part held there
        self.kv_here: dict[int, Part] = {}
        self.kv_there: dict[tuple[int, int], Part] = {}
        # queries kept across rounds, likewise: q owner -> part held here; (peer, owner) -> there
        self.q_here: dict[int, Part] = {}
        self.q_there: dict[tuple[int, int], Part] = {}
        # Note [Merging a round late]: a partner's partial is merged one partner task after the
        # task that receives it (MERGE_LAG), which gives the partner a block's time to send it;
        # the partials of a round's last task for this rank's own q and kv are merged in the
        # next round, after its first block (or at the end), so that a round never waits for a
        # result it does not need to finish. Merging them all after the next round kept every
        # partner's receive buffer alive through a second round: at 2 x 8 (GQA 4:1) attention
        # memory was 1.50x ring's, now 1.12x; the simulator charges the backward 0.2-1.5% for
        # the earlier waits on H100 and L20 (lag 2: 1.23x, at most 0.4%).
        self.deferred_merges: list[Payload] = []
        self.early_merges: list[Payload] = []
        self.posted_cross: set[int] = set()
        # Note [Chained cross pieces]: offset -> exchanges of its pieces not posted yet, and the
        # handle of the last one posted
        self.cross_queue: dict[int, list[list]] = {}
        self.cross_handle: dict[int, int] = {}
        # Note [Receiving results early]: offset -> (piece, op) of its returns not posted yet
        self.return_queue: dict[int, list[tuple[int, Op]]] = {}
        self.ahead_cache: dict[tuple, list[Part | None]] = {}
        # the earliest round still open (Note [Foreign pieces first]); None: the current one
        self.ahead_from: int | None = None
        # Pure lookups that every round repeats for every partner (hundreds of thousands of
        # calls per program at CP 128); none depends on this rank, so one memo serves every
        # rank's passes of the same layout and config.
        self._memo = _shared_memo(layout, causal, cfg)

    # --- query sets, kv sets and rounds (identical for all ranks of a node) --------------------

    def pieces(self, owner: int, node: int) -> tuple[Part, ...]:
        """How the crossing input (q, or kv) of ``owner`` travels to ``node``: one part, or two
        halves (a foreign q needed whole)."""
        key = ("pieces", owner, node)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self._pieces(owner, node)
        return got  # type: ignore[return-value]

    def _pieces(self, owner: int, node: int) -> tuple[Part, ...]:
        if self.kv_cross:
            part = foreign_kv_part(owner, node, self.layout, self.causal)
        else:
            part = foreign_q_part(owner, node, self.layout, self.causal)
        if part == Part.FULL and self.cfg.split_foreign and not self.combined:
            # whole foreign blocks are unmasked, so they may be computed in halves (of q, or of
            # kv): the first half's results travel back while the second half still crosses
            return (Part.FIRST, Part.SECOND)
        return (part,)

    def source(self, cp_rank: int, offset: int) -> int:
        layout = self.layout
        node = (layout.node(cp_rank) - offset) % layout.num_nodes
        return layout.rank(node, layout.local(cp_rank))

    def rounds(self) -> list[list[Slot]]:
        """Rounds as lists of (node offset, piece index)."""
        m = self.layout.num_nodes
        if self.combined:
            steps: list[list[Slot]] = [[] for _ in range(algorithm2_step(m - 1) + 1)]
            for o in range(m):
                steps[algorithm2_step(o)].append((o, 0))
            return steps
        foreign = []
        for o in range(1, m):
            count = len(self.pieces(self.source(self.x, o), self.layout.node(self.x)))
            foreign += [[(o, i)] for i in range(count)]
        if self.kv_cross and self.bwd:
            # The backward's float32 dk/dv returns are larger than the kv that came in: the own
            # round goes last, so that it hides the last return instead of the first arrival.
            return foreign + [[(0, 0)]]
        return [[(0, 0)], *foreign]

    def qsets(self, cp_rank: int, rnd: list[Slot]) -> tuple[QSet, ...]:
        """The query sets ``cp_rank`` hosts in round ``rnd``."""
        key = ("qsets", cp_rank, tuple(rnd))
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = tuple(self._qsets(cp_rank, rnd))
        return got  # type: ignore[return-value]

    def _qsets(self, cp_rank: int, rnd: list[Slot]) -> Sequence[QSet]:
        if self.kv_cross:
            return [(cp_rank, Part.FULL)]
        node = self.layout.node(cp_rank)
        out = []
        for o, i in rnd:
            if o == 0:
                out.append((cp_rank, Part.FULL))
            else:
                g = self.source(cp_rank, o)
                out.append((g, self.pieces(g, node)[i]))
        return out

    def kvset(self, cp_rank: int, rnd: list[Slot]) -> KVSet:
        """The kv set ``cp_rank`` hosts in round ``rnd``."""
        o, i = rnd[-1]
        if o == 0:
            return (cp_rank, Part.FULL)
        key = ("kvset", cp_rank, o, i)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self._kvset(cp_rank, o, i)
        return got  # type: ignore[return-value]

    def _kvset(self, cp_rank: int, o: int, i: int) -> KVSet:
        if not self.kv_cross:
            return (cp_rank, Part.FULL)
        g = self.source(cp_rank, o)
        return (g, self.pieces(g, self.layout.node(cp_rank))[i])

    def block(self, qs: QSet, ks: KVSet) -> tuple[Part, Part, bool] | None:
        """The block of a query set against a kv set: its parts, or ``None`` if empty."""
        key = (qs, ks)
        if key in self._memo:
            return self._memo[key]  # type: ignore[return-value]
        qp, kp, masked = block_parts(qs[0], ks[0], self.causal)
        rq, rk = restrict(qp, qs[1]), restrict(kp, ks[1])
        got = self._memo[key] = None if rq is None or rk is None else (rq, rk, masked)
        return got

    def kv_part(self, qsets: Sequence[QSet], ks: KVSet) -> Part | None:
        """The part of a kv set that the query sets' blocks use (``None``: no block)."""
        key = ("kv_part", qsets, ks)
        if key in self._memo:
            return self._memo[key]  # type: ignore[return-value]
        part: Part | None = None
        for qs in qsets:
            blk = self.block(qs, ks)
            if blk is not None:
                part = blk[1] if part is None else part.union(blk[1])
        self._memo[key] = part
        return part

    def compute(self, qs: QSet, ks: KVSet) -> None:
        blk = self.block(qs, ks)
        if blk is not None:
            self.b.compute(qs[0], ks[0], *blk, q_kind=self.qkind)
            self.flush_early_merges()

    def flush_early_merges(self) -> None:
        """Merge the previous round's partials for this rank's own q and kv (Note [Merging a
        round late]) after this round's first block, which gives them time to arrive."""
        for payload in self.early_merges:
            self.b.merge(payload)
        self.early_merges = []

    def q_parts(self, qsets: Sequence[QSet], ks: KVSet) -> tuple[tuple[int, Part], ...]:
        """``(q owner, part)`` of every query set's block against a kv set."""
        key = ("q_parts", qsets, ks)
        got = self._memo.get(key)
        if got is None:
            got = [(g, blk[0]) for g, p in qsets if (blk := self.block((g, p), ks))]
            self._memo[key] = got = tuple(got)
        return got  # type: ignore[return-value]

    # --- cross-node level -----------------------------------------------------------------------

    def cross_route(self, offset: int) -> CrossRoute:
        layout, x = self.layout, self.x
        node = layout.node(x)
        dst = layout.rank((node + offset) % layout.num_nodes, layout.local(x))
        src = self.source(x, offset)
        return CrossRoute(dst, src, self.pieces(x, layout.node(dst)), self.pieces(src, node))

    @property
    def cross_channel(self) -> tuple[Kind, str]:
        return (Kind.KV, "cross.kv") if self.kv_cross else (self.qkind, "cross.q")

    def post_cross_inputs(self, rnd: list[Slot]) -> None:
        """Ship this rank's q (or kv) to, and receive the q (or kv) from, the nodes a round's
        slots name: the first piece now, the others chained (Note [Chained cross pieces])."""
        kind, channel = self.cross_channel
        for o, _ in rnd:
            if o == 0 or o in self.posted_cross:
                continue
            self.posted_cross.add(o)
            route = self.cross_route(o)
            exchanges = []
            for i in range(max(len(route.mine), len(route.theirs))):
                ops = []
                if i < len(route.mine):
                    ops.append(send(route.dst, kind, self.x, route.mine[i]))
                if i < len(route.theirs):
                    ops.append(recv(route.src, kind, route.src, route.theirs[i]))
                exchanges.append(ops)
            if self.combined or self.layout.num_nodes > 2:  # all at once
                for ops in exchanges:
                    self.b.exchange(channel, ops)
                continue
            self.cross_handle[o] = self.b.exchange(channel, exchanges[0])
            self.cross_queue[o] = exchanges[1:]
            if self.cross_result is not None:
                self.return_queue[o] = self.returns_in_order(o)
                self.post_returns(o, ready=-1)

    def chain_cross(self, rnd: list[Slot]) -> None:
        """Note [Chained cross pieces]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A foreign input that crosses in two pieces used to be posted as two exchanges at once.
        On gloo both then share the slow link and the first piece arrives no earlier than the
        second (NCCL runs the exchanges of one channel in order anyway). So the next piece is
        posted in the round that computes the current one, after the current one has arrived:
        the first piece gets the whole link, and its results can start back while the next
        piece crosses. The round of a rank's last foreign piece posts whatever it still sends.
        Every rank posts exchange ``i + 1`` of an offset in its round for piece ``i``, so both
        sides of the channel keep the same order. Only with two nodes: with more, one channel
        carries several offsets, whose chained pieces would interleave in different orders on
        different ranks, a deadlock under NCCL's in-order channels (the validator finds it for
        3 x 1); there every piece goes at once, as the next offset's does.
        """
        channel = self.cross_channel[1]
        for o, i in rnd:
            queue = self.cross_queue.get(o)
            if not queue:
                continue
            self.b.wait(self.cross_handle[o])
            last = i == len(self.cross_route(o).theirs) - 1
            while queue:
                self.cross_handle[o] = self.b.exchange(channel, queue.pop(0))
                if not last:
                    break

    @property
    def cross_result(self) -> Kind | None:
        """What returns across nodes: the results of foreign q, the dk/dv of foreign kv (backward
        only: a forward with kv crossing returns nothing)."""
        if not self.kv_cross:
            return self.result_kind
        return Kind.DKV if self.bwd else None

    def post_cross_results(self, offset: int, steps: range) -> None:
        """Return the results of ``steps`` pieces of the foreign input; receive this rank's."""
        kind = self.cross_result
        assert kind is not None
        route = self.cross_route(offset)
        for i in steps:
            ops = []
            if i < len(route.theirs):
                ops.append(send(route.src, kind, route.src, route.theirs[i]))
            if i < len(route.mine):
                held = self.cross_held(route.dst, offset, i, route.mine[i])
                ops.append(recv(route.dst, kind, self.x, route.mine[i], held=held))
            self.b.exchange("cross.o", ops)

    def cross_held(self, host: int, offset: int, i: int, piece: Part) -> int:
        """Blocks in ``host``'s result for piece ``i`` of this rank's crossing input when it
        sends it back: the blocks its node computes against the piece, each computed at
        ``host`` counting 1 and each merged from a partner counting 2 (Note [Wire
        precision]). ``host`` runs the piece in the round ``[(offset, i)]`` of its own node."""
        layout, mine = self.layout, (self.x, piece)
        # combined rounds are the same on every node (whole pieces); others: one slot each
        rnd = next(r for r in self.rounds() if (offset, i) in r) if self.combined else [(offset, i)]

        def blocks(r: int) -> int:
            if self.kv_cross:  # r's queries against this rank's kv piece
                return len(self.q_parts(self.qsets(r, rnd), mine))
            return 0 if self.block(mine, self.kvset(r, rnd)) is None else 1

        held = blocks(host)
        node = layout.node(host)
        for task in partner_tasks(layout.local(host), layout.ranks_per_node, self.cfg.split):
            n = blocks(layout.rank(node, task.peer_local))
            # q crossing: host computes against a kv partner's kv itself, a q partner returns
            # a partial; kv crossing: the reverse
            at_host = task.exchange_kv != self.kv_cross
            held += (n if at_host else 2) if n else 0
        return held

    def returns_in_order(self, offset: int) -> list[tuple[int, Op]]:
        """Note [Receiving results early]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A result can cross only when its receiver has posted the receive (gloo, and NCCL above
        its eager size, hand data over when both sides are there). Posted as one exchange per
        piece, (send the foreign piece's result, receive this rank's), the receive waited for
        this rank's own foreign result: on 2 x 2 shared at 100 Mbit/s a result ready at 181 ms
        left at 396 ms, when its receiver had finished its own foreign piece.

        With two nodes every result therefore travels in an exchange of its own, in one order
        that both ranks of the pair derive alike (by piece, the lower node's result first), and
        a rank posts each receive as soon as everything before it in that order is posted: the
        leading receives right after the cross inputs, the others right after the result sent
        before them. Sends go when their piece is computed. One order on both sides keeps
        NCCL's in-order channels matched::

            node 0 rank:  send r(1).0 | recv r(0).0 | send r(1).1
            node 1 rank:  recv r(1).0 | send r(0).0 | recv r(1).1
                          (r(a).i: node a's result for piece i; recv r(1).0 posted at the start)

        With more nodes one channel carries several offsets and the one-exchange-per-piece
        form is kept (Note [Chained cross pieces]).
        """
        route = self.cross_route(offset)
        kind = self.cross_result
        assert kind is not None and route.src == route.dst
        lower_first = self.layout.node(self.x) < self.layout.node(route.src)
        ordered: list[tuple[int, Op]] = []
        for i in range(max(len(route.mine), len(route.theirs))):
            out, back = [], []
            if i < len(route.theirs):
                out = [send(route.src, kind, route.src, route.theirs[i])]
            if i < len(route.mine):
                held = self.cross_held(route.dst, offset, i, route.mine[i])
                back = [recv(route.dst, kind, self.x, route.mine[i], held=held)]
            ordered += [(i, op) for op in (out + back if lower_first else back + out)]
        return ordered

    def post_returns(self, offset: int, ready: int) -> None:
        """Post the returns of ``offset`` whose turn has come (Note [Receiving results early]):
        receives at once, the results of pieces up to ``ready``."""
        queue = self.return_queue[offset]
        while queue and (not queue[0][1].send or queue[0][0] <= ready):
            self.b.exchange("cross.o", [queue.pop(0)[1]])

    def return_round(self, rnd: list[Slot]) -> None:
        """After a round: its foreign results cross back (the last piece also posts the steps
        that this rank still receives, when the two directions have different piece counts)."""
        if self.cross_result is None:
            return
        for o, i in rnd:
            if o == 0:
                continue
            route = self.cross_route(o)
            last = i == len(route.theirs) - 1
            if o in self.return_queue:
                self.post_returns(o, len(route.theirs) if last else i)
                continue
            end = max(len(route.mine), len(route.theirs)) if last else i + 1
            self.post_cross_results(o, range(i, end))

    # --- the program ----------------------------------------------------------------------------

    def build(self) -> Program:
        rnds = self.rnds = self.rounds()
        self.post_cross_inputs(rnds[0])
        if self.own_diagonal_ahead(rnds):
            own = (self.x, Part.FULL)
            self.compute(own, own)
        first = 0
        if self.foreign_inside_own(rnds):
            # Note [Foreign pieces first]
            def foreign() -> None:
                self.ahead_from = 0  # the own round is still open: what it sends counts
                self.run_round(1)
                self.cur, self.ahead_from = 0, None
                # its partials for this rank's own kv are merged after the own round's next
                # block, before the own round's receives of other parts of the same tensor
                self.early_merges, self.deferred_merges = self.deferred_merges, []

            self.run_round(0, between=foreign)
            first = 2
        for r in range(first, len(rnds)):
            self.run_round(r)
        for payload in self.deferred_merges:
            self.b.merge(payload)
        if self.cross_result is not None:
            for o in range(1, self.layout.num_nodes):
                for part in self.cross_route(o).mine:
                    self.b.merge(Payload(self.cross_result, self.x, part))
        return self.b.finish()

    def foreign_inside_own(self, rnds: list[list[Slot]]) -> bool:
        """Note [Foreign pieces first]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        With two nodes the own round comes first and the foreign pieces after it, chained (Note
        [Chained cross pieces]). Run as written, a rank computes all of its own blocks before it
        looks at the first foreign piece, which arrived during the own diagonal: the next piece
        leaves, and the first piece's results start back, only after the own round, and the
        slow link idles in between in both directions (2 x 2 shared, 100 Mbit/s: the second q
        piece left at 330 ms instead of about 170, the first results at 495 ms).

        So the forward runs the first foreign round inside the own round, right after the own
        diagonal blocks (which need no input and hide the first piece's crossing)::

            own diagonal | wait piece 1, post piece 2 | foreign piece 1 -> results back
                         | own partner blocks | foreign piece 2 -> results back | ...

        Both ranks of every channel build the same order, so the exchanges of each channel still
        match one to one. Own tensors that the nested round sends go whole for the own round
        too (``ahead_from``), so nothing is sent twice.

        Where not (``scripts/bench/foreign_first.py``, docs/results/foreign-first.md):

        * the backward: its own round's partials and the foreign bundle are then alive together,
          +12-14% attention memory for multi-head attention, and at eight ranks per node the
          simulator predicts the backward 1.3x slower;
        * kv crossing (GQA): the forward returns nothing, so only the wait moves earlier;
        * more than two nodes (every piece is posted at once) and ``combine_nodes``.
        """
        return (
            self.layout.num_nodes == 2
            and not self.combined
            and len(rnds) >= 2
            and rnds[0] == [(0, 0)]
            and not self.bwd
            and not self.kv_cross
        )

    def own_diagonal_ahead(self, rnds: list[list[Slot]]) -> bool:
        """Note [Own diagonal ahead]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        The backward with kv crossing runs its own round last (:meth:`rounds`), so that the own
        blocks hide the last float32 dk/dv return. Run as written, every rank first waits for
        the first foreign kv piece to cross, with nothing to compute: on the H100 preset at 2 x 8
        with shared NICs (32 query heads over 8 kv heads, 128K) a 3.2 ms wait, which made the
        backward 1% slower than ring's when compute dominates.

        The own diagonal block needs no input, so it runs first, while the first piece crosses::

            post cross kv piece 1 | own diagonal | foreign rounds ... | own round (no diagonal)

        Its dq and dk/dv go into the rank's own accumulators, which live through the whole pass,
        and it sends nothing, so the exchanges and the memory of the rounds are unchanged.
        """
        return self.bwd and self.kv_cross and len(rnds) >= 2 and rnds[-1] == [(0, 0)]

    def run_round(self, r: int, between: Callable[[], None] | None = None) -> None:
        """Round ``r``: post the next round's cross inputs, the intra-node pipeline (with
        ``between`` run after the round's own diagonal blocks), the foreign results back."""
        rnds = self.rnds
        self.cur = r
        if r + 1 < len(rnds):
            self.post_cross_inputs(rnds[r + 1])
        self.early_merges, self.deferred_merges = self.deferred_merges, []
        self.intra_round(rnds[r], between)
        self.return_round(rnds[r])
        self.flush_early_merges()

    # --- one round of the intra-node pipeline ---------------------------------------------------

    def intra_round(self, rnd: list[Slot], between: Callable[[], None] | None = None) -> None:
        my_qs, my_kv = self.qsets(self.x, rnd), self.kvset(self.x, rnd)
        window = _Window(self, rnd, my_qs)
        # Exchanges go out before the diagonal block they should overlap (on CUDA a transfer
        # posted after a compute starts after it): kv exchanges carry only home tensors; q
        # exchanges too when the round hosts no foreign query set, which may still be crossing
        # the node boundary (waiting for it would hold back the diagonal block).
        home = all(qs[0] == self.x for qs in my_qs)
        window.top_up(("kv", "q") if home else ("kv",))
        self.chain_cross(rnd)
        for qs in my_qs:
            if qs[0] == self.x and not (my_kv == qs and self.own_diagonal_ahead(self.rnds)):
                self.compute(qs, my_kv)
        if between is not None:
            between()
        window.top_up(("q",))
        for qs in my_qs:
            if qs[0] != self.x:
                self.compute(qs, my_kv)
        # Note [Merging a round late]
        lagging: list[list[Payload]] = []
        # Compute order: by level, q exchanges first (their outputs must travel back), then by j.
        for task in sorted(window.tasks, key=lambda t: (t.level, t.exchange_kv, t.j)):
            window.top_up()
            if task.exchange_kv:
                lagging.append(self.kv_partner_blocks(task, rnd, my_qs, my_kv))
            else:
                lagging.append(self.q_partner_blocks(task, rnd, my_qs, my_kv))
            window.done["kv" if task.exchange_kv else "q"] += 1
            if len(lagging) > MERGE_LAG:
                for p in lagging.pop(0):
                    self.b.merge(p)
        # a foreign set's partials must be merged before its result crosses back
        for p in (p for returns in lagging for p in returns):
            if p.owner == self.x:
                self.deferred_merges.append(p)
            else:
                self.b.merge(p)

    def kv_partner_blocks(
        self, task: PartnerTask, rnd: list[Slot], my_qs: Sequence[QSet], my_kv: KVSet
    ) -> list[Payload]:
        """My query sets against the partner's kv set; backward: swap the dk/dv partials."""
        y = self.layout.rank(self.layout.node(self.x), task.peer_local)
        their_kv = self.kvset(y, rnd)
        for qs in my_qs:
            self.compute(qs, their_kv)
        if not self.bwd:
            return []
        mine, theirs = self.kv_part(my_qs, their_kv), self.kv_part(self.qsets(y, rnd), my_kv)
        ops = [send(y, Kind.DKV, their_kv[0], mine)] if mine is not None else []
        if theirs is not None:  # y's query sets against my kv set, one block each
            held = len(self.q_parts(self.qsets(y, rnd), my_kv))
            ops.append(recv(y, Kind.DKV, my_kv[0], theirs, held=held))
        if ops:
            self.b.exchange(self.channel["o"], ops)
        return [op.payload for op in ops if not op.send]

    def q_partner_blocks(
        self, task: PartnerTask, rnd: list[Slot], my_qs: Sequence[QSet], my_kv: KVSet
    ) -> list[Payload]:
        """The partner's query sets against my kv set; their results go back, mine come in."""
        y = self.layout.rank(self.layout.node(self.x), task.peer_local)
        peer_qs = self.qsets(y, rnd)
        for qs in peer_qs:
            self.compute(qs, my_kv)
        kind = self.result_kind
        ops = [send(y, kind, g, part) for g, part in self.q_parts(peer_qs, my_kv)]
        # y computes each of my query sets against its kv set once: one block per result
        their_kv = self.kvset(y, rnd)
        ops += [recv(y, kind, g, part, held=1) for g, part in self.q_parts(my_qs, their_kv)]
        if ops:
            self.b.exchange(self.channel["o"], ops)
        return [op.payload for op in ops if not op.send]

    def ahead(self, key: tuple, use: Callable[[list[Slot]], Part | None]) -> Part | None:
        """The union of ``use(round)`` over this round and the later ones.

        A rank's own q or kv that a partner needs in several rounds is sent once, whole for all
        of them, the first time it is needed: a later round that needs another half would
        otherwise send the tensor again with the half the partner already holds.
        """
        suffix = self.ahead_cache.get(key)
        if suffix is None:
            # unions over every suffix of the rounds, built once per key (a node may have
            # hundreds of rounds)
            suffix = [None] * (len(self.rnds) + 1)
            for i in range(len(self.rnds) - 1, -1, -1):
                p, later = use(self.rnds[i]), suffix[i + 1]
                suffix[i] = later if p is None else (p if later is None else p.union(later))
            self.ahead_cache[key] = suffix
        return suffix[self.cur if self.ahead_from is None else min(self.cur, self.ahead_from)]

    def own_kv_use(self, q_host: int, kv_rank: int, rnd: list[Slot]) -> Part | None:
        """What ``q_host``'s query sets use of ``kv_rank``'s own kv in ``rnd``."""
        ks = self.kvset(kv_rank, rnd)
        return self.kv_part(self.qsets(q_host, rnd), ks) if ks[0] == kv_rank else None

    def own_q_use(self, q_rank: int, kv_host: int, rnd: list[Slot]) -> Part | None:
        """What ``kv_host``'s kv set uses of ``q_rank``'s own queries in ``rnd``."""
        own = tuple(qs for qs in self.qsets(q_rank, rnd) if qs[0] == q_rank)
        parts = [p for _, p in self.q_parts(own, self.kvset(kv_host, rnd))]
        return None if not parts else functools.reduce(Part.union, parts)

    def post(self, task: PartnerTask, my_qs: Sequence[QSet], rnd: list[Slot]) -> None:
        """Post the input exchange with a partner: kv (what is not held yet) or query sets."""
        x = self.x
        y = self.layout.rank(self.layout.node(x), task.peer_local)
        peer_qs = self.qsets(y, rnd)
        my_kv, their_kv = self.kvset(x, rnd), self.kvset(y, rnd)
        if not task.exchange_kv:
            ops = [
                send(y, self.qkind, g, missing)
                for g, need in self.q_parts(my_qs, their_kv)
                if (missing := self._q_missing(self.q_there, (y, g), need, g == x, x, y))
            ]
            ops += [
                recv(y, self.qkind, g, missing)
                for g, need in self.q_parts(peer_qs, my_kv)
                if (missing := self._q_missing(self.q_here, g, need, g == y, y, x))
            ]
            if ops:
                self.b.exchange(self.channel["q"], ops)
            return
        # A kv that arrived in an earlier round is kept if it covers what this round needs
        # (both sides know both holdings, so they agree on what moves). Own kv is widened to
        # what earlier rounds used too, since later rounds may need it again; a foreign kv
        # piece is sent as it is (its other half belongs to another round).
        ops = []
        there, here = self.kv_part(peer_qs, my_kv), self.kv_part(my_qs, their_kv)
        if there and my_kv[0] == x:
            there = self.ahead(("kv", y, x), lambda r: self.own_kv_use(y, x, r))
        if here and their_kv[0] == y:
            here = self.ahead(("kv", x, y), lambda r: self.own_kv_use(x, y, r))
        if there and (there := _missing(self.kv_there, (y, my_kv[0]), there, my_kv[0] == x)):
            ops.append(send(y, Kind.KV, my_kv[0], there))
        if here and (here := _missing(self.kv_here, their_kv[0], here, their_kv[0] == y)):
            ops.append(recv(y, Kind.KV, their_kv[0], here))
        if ops:
            self.b.exchange(self.channel["kv"], ops)

    def _q_missing(
        self, held: dict, key: object, need: Part, own: bool, q_rank: int, kv_host: int
    ) -> Part | None:
        """:func:`_missing` for queries: own queries go whole for every round that needs them."""
        if own:
            key = ("q", q_rank, kv_host)
            need = self.ahead(key, lambda r: self.own_q_use(q_rank, kv_host, r)) or need
        return _missing(held, key, need, widen=own)


def _missing(held: dict, key: object, need: Part, widen: bool) -> Part | None:
    """The part to send so that the holder of ``held[key]`` covers ``need`` (``None``: it does
    already), and record it. ``widen`` (a rank's own tensor, which later rounds may need again)
    sends the union with what is held; a foreign piece is sent as it is."""
    have = held.get(key)
    if have is not None and have.contains(need):
        return None
    part = need.union(have) if have is not None and widen else need
    held[key] = part
    return part


class _Window:
    """The prefetch window of one round: up to ``window`` input exchanges in flight per channel
    (kv and q) ahead of the computation that consumes them."""

    def __init__(self, owner: _Pass, rnd: list[Slot], my_qs: Sequence[QSet]) -> None:
        self.owner, self.rnd, self.my_qs = owner, rnd, my_qs
        layout = owner.layout
        self.tasks = partner_tasks(layout.local(owner.x), layout.ranks_per_node, owner.cfg.split)
        self.queue = {
            "kv": [t for t in self.tasks if t.exchange_kv],
            "q": [t for t in self.tasks if not t.exchange_kv],
        }
        self.posted = {"kv": 0, "q": 0}
        self.done = {"kv": 0, "q": 0}

    def top_up(self, channels: tuple[str, ...] = ("kv", "q")) -> None:
        for c in channels:
            queue = self.queue[c]
            while (
                self.posted[c] < len(queue)
                and self.posted[c] < self.done[c] + self.owner.cfg.window
            ):
                self.owner.post(queue[self.posted[c]], self.my_qs, self.rnd)
                self.posted[c] += 1


@functools.lru_cache(maxsize=128)
def pipeline_program(
    cp_rank: int, layout: Layout, causal: bool, cfg: PipelineConfig, backward: bool
) -> Program:
    """``cp_rank``'s program for one pass (immutable). Cached: charm's auto choices replay the
    same small layout's ranks for several levels, whose passes often are the same schedule (a
    backward that keeps the forward's queries is scheduled as one that receives them)."""
    return _Pass(cp_rank, layout, causal, cfg, backward).build()
