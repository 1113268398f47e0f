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
half still crosses. The next offset's q travels while the current one computes::

    node a        round 0        round 1            round 2            round 3 ...
    cross q     -- q(a-1).first -- q(a-1).second --- q(a-2) ...
    intra       RM+ own q      RM+ q(a-1).first   RM+ q(a-1).second  ...
    cross out                  out(a-1).first --- out(a-1).second -----------> (last exposed)

``combine_two_nodes`` gives the paper's Algorithm 2 for ``m = 2`` instead: one round over both
query sets ([own, foreign]); the foreign q must then arrive before the q exchanges start.

The rank that ran a foreign query set returns its merged (out, lse), and the owner merges it. The
backward mirrors this: the foreign rank receives (q, out, dout, lse), runs the same pipeline, keeps
dk/dv at home and returns dq.

Inside a round, rank ``x`` prefetches ``window`` exchanges per channel ahead of its computation and
computes each block as soon as its own inputs arrived; a partner's kv that an earlier round brought
is kept and reused when it covers what the round needs; q-exchange blocks come first in a level so
their outputs start travelling back early (paper Appendix A).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_charm.plan.builder import ProgramBuilder, recv, send
from megatron_charm.plan.layout import block_parts
from megatron_charm.plan.partners import PartnerTask, partner_tasks
from megatron_charm.plan.types import Kind, Layout, Op, Part, Payload, Program

QSet = tuple[int, Part]  # (q owner, part of its local sequence that a round covers)


@dataclass(frozen=True)
class PipelineConfig:
    split: bool
    """RM+ q/kv split (False: the plain merge mechanism, kv only)."""
    scope: str
    """Channel scope of the intra-node pipeline: ``"intra"`` or ``"full"``."""
    window: int = 2
    """Exchanges in flight per channel."""
    combine_two_nodes: bool = False
    """For two nodes, run own and foreign q in one round (paper Algorithm 2)."""
    split_foreign: bool = True
    """Ship a foreign q that is needed whole as two halves, processed in two rounds."""


def foreign_q_part(q_owner: int, node: int, layout: Layout, causal: bool) -> Part:
    """Part of q of ``q_owner`` that node ``node``'s kv can see (union over the node's ranks)."""
    first, last = layout.rank(node, 0), layout.rank(node, layout.ranks_per_node - 1)
    if first <= q_owner <= last:
        return Part.FULL
    # every rank of another node is on the same side of q_owner, so one block decides
    return block_parts(q_owner, first, causal)[0]


def restrict(block_q: Part, piece: Part) -> Part | None:
    """The q part of a block limited to a query set's piece; ``None`` if they do not overlap."""
    if piece == Part.FULL or block_q == piece:
        return block_q
    if block_q == Part.FULL:
        return piece
    return None


class _Pass:
    """Builds one rank's program for one pass (forward or backward)."""

    def __init__(self, cp_rank: int, layout: Layout, causal: bool, cfg: PipelineConfig, bwd: bool):
        self.x = cp_rank
        self.lay = layout
        self.causal = causal
        self.cfg = cfg
        self.bwd = bwd
        self.b = ProgramBuilder(cp_rank)
        self.qkind = Kind.QB if bwd else Kind.Q
        self.ret = Kind.DQ if bwd else Kind.O  # what a q exchange returns
        self.ch = {c: f"{cfg.scope}.{c}" for c in ("kv", "q", "o")}
        self.combined = cfg.combine_two_nodes and layout.num_nodes == 2
        # kv kept across rounds: peer -> part of kv[peer] held here, and part of kv[x] held there
        self.kv_here: dict[int, Part] = {}
        self.kv_there: dict[int, Part] = {}
        # Partials for this rank's own q and kv are merged one round late (or at the end), so
        # that a round never waits for a partner's result it does not need to finish.
        self.late: list[Payload] = []

    # --- query sets and rounds (identical for all ranks of a node) ----------------------------

    def pieces(self, q_owner: int, node: int) -> list[Part]:
        """How q of ``q_owner`` travels to ``node``: one part, or two halves."""
        part = foreign_q_part(q_owner, node, self.lay, self.causal)
        if part == Part.FULL and self.cfg.split_foreign and not self.combined:
            return [Part.FIRST, Part.SECOND]
        return [part]

    def source(self, cp_rank: int, offset: int) -> int:
        lay = self.lay
        return lay.rank((lay.node(cp_rank) - offset) % lay.num_nodes, lay.local(cp_rank))

    def rounds(self) -> list[list[tuple[int, int]]]:
        """Rounds as lists of (node offset, piece index)."""
        m = self.lay.num_nodes
        if self.combined:
            return [[(0, 0), (1, 0)]]
        out = [[(0, 0)]]
        for o in range(1, m):
            count = len(self.pieces(self.source(self.x, o), self.lay.node(self.x)))
            out += [[(o, i)] for i in range(count)]
        return out

    def qsets(self, cp_rank: int, rnd: list[tuple[int, int]]) -> list[QSet]:
        node = self.lay.node(cp_rank)
        out = []
        for o, i in rnd:
            if o == 0:
                out.append((cp_rank, Part.FULL))
            else:
                g = self.source(cp_rank, o)
                out.append((g, self.pieces(g, node)[i]))
        return out

    def block(self, qs: QSet, kv_owner: int) -> tuple[Part, Part, bool] | None:
        qp, kp, masked = block_parts(qs[0], kv_owner, self.causal)
        rq = restrict(qp, qs[1])
        return None if rq is None else (rq, kp, masked)

    def kv_part(self, qsets: list[QSet], kv_owner: int) -> Part:
        part: Part | None = None
        for qs in qsets:
            blk = self.block(qs, kv_owner)
            if blk is not None:
                part = blk[1] if part is None else part.union(blk[1])
        assert part is not None, "a kv exchange that no block uses"
        return part

    def compute(self, qs: QSet, kv_owner: int) -> None:
        blk = self.block(qs, kv_owner)
        if blk is not None:
            self.b.compute(qs[0], kv_owner, *blk, q_kind=self.qkind)

    def q_ops(self, peer: int, mine: list[QSet], theirs: list[QSet], kind: Kind) -> list[Op]:
        """Swap query sets (or their results) with ``peer``, each at the part its block uses."""
        ops = [send(peer, kind, g, blk[0]) for g, p in mine if (blk := self.block((g, p), peer))]
        ops += [
            recv(peer, kind, g, blk[0]) for g, p in theirs if (blk := self.block((g, p), self.x))
        ]
        return ops

    # --- the program ----------------------------------------------------------------------------

    def build(self) -> Program:
        lay, x = self.lay, self.x
        node, m = lay.node(x), lay.num_nodes
        rnds = self.rounds()
        posted_q: set[int] = set()

        def cross_plan(o: int) -> tuple[int, int, list[Part], list[Part]]:
            dst, src = lay.rank((node + o) % m, lay.local(x)), self.source(x, o)
            return dst, src, self.pieces(x, lay.node(dst)), self.pieces(src, node)

        def post_cross_q(rnd: list[tuple[int, int]]) -> None:
            for o, _ in rnd:
                if o == 0 or o in posted_q:
                    continue
                posted_q.add(o)
                dst, src, mine, theirs = cross_plan(o)
                for i in range(max(len(mine), len(theirs))):
                    ops = [send(dst, self.qkind, x, mine[i])] if i < len(mine) else []
                    ops += [recv(src, self.qkind, src, theirs[i])] if i < len(theirs) else []
                    self.b.exchange("cross.q", ops)

        def post_cross_o(o: int, steps: range) -> None:
            dst, src, mine, theirs = cross_plan(o)
            for i in steps:
                ops = [send(src, self.ret, src, theirs[i])] if i < len(theirs) else []
                ops += [recv(dst, self.ret, x, mine[i])] if i < len(mine) else []
                self.b.exchange("cross.o", ops)

        post_cross_q(rnds[0])
        for r, rnd in enumerate(rnds):
            if r + 1 < len(rnds):
                post_cross_q(rnds[r + 1])
            earlier, self.late = self.late, []
            self.intra_round(rnd)
            for o, i in rnd:
                if o == 0:
                    continue
                _, _, mine, theirs = cross_plan(o)
                last = i == len(theirs) - 1
                post_cross_o(o, range(i, max(len(mine), len(theirs)) if last else i + 1))
            for payload in earlier:
                self.b.reduce(payload)
        for payload in self.late:
            self.b.reduce(payload)
        for o in range(1, m):
            for part in cross_plan(o)[2]:
                self.b.reduce(Payload(self.ret, x, part))
        return self.b.finish()

    def intra_round(self, rnd: list[tuple[int, int]]) -> None:
        lay, x, b = self.lay, self.x, self.b
        node = lay.node(x)
        my_qs = self.qsets(x, rnd)
        tasks = partner_tasks(lay.local(x), lay.ranks_per_node, self.cfg.split)
        # Compute order: by level, q exchanges first (their outputs must travel back), then by j.
        order = sorted(tasks, key=lambda t: (t.level, t.exchange_kv, t.j))
        per_channel = {
            "kv": [t for t in tasks if t.exchange_kv],
            "q": [t for t in tasks if not t.exchange_kv],
        }
        posted = {"kv": 0, "q": 0}
        done = {"kv": 0, "q": 0}

        def top_up(channels: tuple[str, ...] = ("kv", "q")) -> None:
            for c in channels:
                lst = per_channel[c]
                while posted[c] < len(lst) and posted[c] < done[c] + self.cfg.window:
                    self.post(lst[posted[c]], my_qs, rnd)
                    posted[c] += 1

        # kv exchanges carry only home tensors, so they start before the diagonal block; q
        # exchanges may carry a foreign query set that is still crossing the node boundary.
        top_up(("kv",))
        for qs in my_qs:
            if qs[0] == x:
                self.compute(qs, x)
        top_up(("q",))
        for qs in my_qs:
            if qs[0] != x:
                self.compute(qs, x)
        returns: list[Payload] = []
        for t in order:
            c = "kv" if t.exchange_kv else "q"
            top_up()
            y = lay.rank(node, t.peer_local)
            peer_qs = self.qsets(y, rnd)
            if t.exchange_kv:
                for qs in my_qs:
                    self.compute(qs, y)
                if self.bwd:
                    mine, theirs = self.kv_part(my_qs, y), self.kv_part(peer_qs, x)
                    b.exchange(
                        self.ch["o"],
                        [send(y, Kind.DKV, y, mine), recv(y, Kind.DKV, x, theirs)],
                    )
                    returns.append(Payload(Kind.DKV, x, theirs))
            else:
                for qs in peer_qs:
                    self.compute(qs, x)
                # results of the partner's queries go back; results of mine come from the partner
                ops = [
                    send(y, self.ret, g, blk[0])
                    for g, p in peer_qs
                    if (blk := self.block((g, p), x))
                ]
                ops += [
                    recv(y, self.ret, g, blk[0]) for g, p in my_qs if (blk := self.block((g, p), y))
                ]
                b.exchange(self.ch["o"], ops)
                returns += [
                    Payload(op.payload.kind, op.payload.owner, op.payload.part)
                    for op in ops
                    if not op.send
                ]
            done[c] += 1
        # a foreign query set's partials must be merged before its result crosses back
        for p in returns:
            if p.owner == x:
                self.late.append(p)
            else:
                b.reduce(p)

    def post(self, t: PartnerTask, my_qs: list[QSet], rnd: list[tuple[int, int]]) -> None:
        x = self.x
        y = self.lay.rank(self.lay.node(x), t.peer_local)
        peer_qs = self.qsets(y, rnd)
        if t.exchange_kv:
            # A kv that arrived in an earlier round is kept if it covers what this round needs
            # (both sides know both holdings, so they agree on what moves).
            ops = []
            there, here = self.kv_part(peer_qs, x), self.kv_part(my_qs, y)
            held_there, held_here = self.kv_there.get(y), self.kv_here.get(y)
            if held_there is None or not held_there.contains(there):
                there = there if held_there is None else there.union(held_there)
                ops.append(send(y, Kind.KV, x, there))
                self.kv_there[y] = there
            if held_here is None or not held_here.contains(here):
                here = here if held_here is None else here.union(held_here)
                ops.append(recv(y, Kind.KV, y, here))
                self.kv_here[y] = here
            if ops:
                self.b.exchange(self.ch["kv"], ops)
        else:
            self.b.exchange(self.ch["q"], self.q_ops(y, my_qs, peer_qs, self.qkind))


def pipeline_program(
    cp_rank: int, layout: Layout, causal: bool, cfg: PipelineConfig, backward: bool
) -> Program:
    return _Pass(cp_rank, layout, causal, cfg, backward).build()
