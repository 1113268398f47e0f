"""Merge, RM+ and CHARM+ schedules: direct fetches in log-depth levels, q and kv on two channels,
and query sets shipped across nodes so that kv never leaves its node.

Note [CHARM+ rounds]
~~~~~~~~~~~~~~~~~~~~
With ``m`` nodes of ``p`` ranks, rank ``(a, l)`` (node ``a``, local index ``l``) sends its q once to
``(a + o, l)`` for every offset ``o = 1..m-1`` and receives the q of ``(a - o, l)``. Each node runs
its intra-node RM+ pipeline (see :mod:`megatron_charm.plan.partners`) over *query sets*:

    m = 1       one round: [own]                               (this is RM+)
    m = 2       one round: [own, foreign]                      (one combined pipeline)
    m > 2       rounds [own], [from a-1], ..., [from a-m+1]    (next round's q travels meanwhile)

    node a          round 0             round 1              round 2
    cross q     ---- q(a-1) arrives --- q(a-2) arrives ---
    intra       RM+ over own q      RM+ over q(a-1)       RM+ over q(a-2)
    cross out                       out(a-1) returns ---- out(a-2) returns ---> (exposed)

The rank that ran a foreign query set returns its merged (out, lse), and the owner merges it. The
backward mirrors this: the foreign rank receives (q, out, dout, lse), runs the same pipeline, keeps
dk/dv at home and returns dq.

Inside a round, rank ``x`` prefetches ``window`` exchanges per channel ahead of its computation and
computes each block as soon as its own inputs arrived; q-exchange blocks come first in a level so
their outputs start travelling back early (paper Appendix A).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_charm.plan.builder import ProgramBuilder, recv, send
from megatron_charm.plan.layout import block_parts
from megatron_charm.plan.partners import PartnerTask, partner_tasks
from megatron_charm.plan.types import Kind, Layout, Op, Part, Payload, Program


@dataclass(frozen=True)
class PipelineConfig:
    split: bool  # RM+ q/kv split (False: plain merge, kv only)
    scope: str  # channel scope of the intra-node pipeline: "intra" or "full"
    window: int = 2  # exchanges in flight per channel


def rounds(num_nodes: int) -> list[list[int]]:
    """Node offsets of the query sets processed in each round."""
    if num_nodes == 1:
        return [[0]]
    if num_nodes == 2:
        return [[0, 1]]
    return [[o] for o in range(num_nodes)]


def foreign_q_part(q_owner: int, node: int, layout: Layout, causal: bool) -> Part:
    """Part of q of ``q_owner`` that node ``node``'s kv can see (union over the node's ranks)."""
    part: Part | None = None
    for local in range(layout.ranks_per_node):
        qp = block_parts(q_owner, layout.rank(node, local), causal)[0]
        part = qp if part is None else part.union(qp)
    assert part is not None
    return part


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

    def qsets(self, cp_rank: int, offsets: list[int]) -> list[int]:
        lay = self.lay
        node, local = lay.node(cp_rank), lay.local(cp_rank)
        return [lay.rank((node - o) % lay.num_nodes, local) for o in offsets]

    def kv_part(self, qs: list[int], kv_owner: int) -> Part:
        part: Part | None = None
        for g in qs:
            kp = block_parts(g, kv_owner, self.causal)[1]
            part = kp if part is None else part.union(kp)
        assert part is not None
        return part

    def build(self) -> Program:
        lay, x = self.lay, self.x
        node, local = lay.node(x), lay.local(x)
        rnds = rounds(lay.num_nodes)
        cross_recv: dict[int, int] = {}

        def post_cross(rnd: list[int]) -> None:
            for o in rnd:
                if o == 0:
                    continue
                dst = lay.rank((node + o) % lay.num_nodes, local)
                src = lay.rank((node - o) % lay.num_nodes, local)
                self.b.exchange(
                    "cross.q",
                    [
                        send(
                            dst, self.qkind, x, foreign_q_part(x, lay.node(dst), lay, self.causal)
                        ),
                        recv(src, self.qkind, src, foreign_q_part(src, node, lay, self.causal)),
                    ],
                )
                cross_recv[o] = src

        post_cross(rnds[0])
        for r, rnd in enumerate(rnds):
            if r + 1 < len(rnds):
                post_cross(rnds[r + 1])
            self.intra_round(rnd)
            foreign = [o for o in rnd if o != 0]
            for o in foreign:
                src = cross_recv[o]
                dst = lay.rank((node + o) % lay.num_nodes, local)
                self.b.exchange(
                    "cross.o",
                    [
                        send(src, self.ret, src, foreign_q_part(src, node, lay, self.causal)),
                        recv(dst, self.ret, x, foreign_q_part(x, lay.node(dst), lay, self.causal)),
                    ],
                )
        for o in range(1, lay.num_nodes):
            dst = lay.rank((node + o) % lay.num_nodes, local)
            self.b.reduce(Payload(self.ret, x, foreign_q_part(x, lay.node(dst), lay, self.causal)))
        return self.b.finish()

    def intra_round(self, offsets: list[int]) -> None:
        lay, x, b = self.lay, self.x, self.b
        node = lay.node(x)
        my_qs = self.qsets(x, offsets)
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
                    self.post(lst[posted[c]], my_qs, offsets)
                    posted[c] += 1

        # kv exchanges carry only home tensors, so they start before the diagonal block; q
        # exchanges may carry a foreign query set that is still crossing the node boundary.
        top_up(("kv",))
        for g in my_qs:
            if g == x:
                b.compute(g, x, *block_parts(g, x, self.causal), q_kind=self.qkind)
        top_up(("q",))
        for g in my_qs:
            if g != x:
                b.compute(g, x, *block_parts(g, x, self.causal), q_kind=self.qkind)
        returns: list[Payload] = []
        for t in order:
            c = "kv" if t.exchange_kv else "q"
            top_up()
            y = lay.rank(node, t.peer_local)
            peer_qs = self.qsets(y, offsets)
            if t.exchange_kv:
                for g in my_qs:
                    b.compute(g, y, *block_parts(g, y, self.causal), q_kind=self.qkind)
                if self.bwd:
                    b.exchange(
                        self.ch["o"],
                        [
                            send(y, Kind.DKV, y, self.kv_part(my_qs, y)),
                            recv(y, Kind.DKV, x, self.kv_part(peer_qs, x)),
                        ],
                    )
                    returns.append(Payload(Kind.DKV, x, self.kv_part(peer_qs, x)))
            else:
                for g in peer_qs:
                    b.compute(g, x, *block_parts(g, x, self.causal), q_kind=self.qkind)
                ops: list[Op] = [
                    send(y, self.ret, g, block_parts(g, x, self.causal)[0]) for g in peer_qs
                ]
                ops += [recv(y, self.ret, g, block_parts(g, y, self.causal)[0]) for g in my_qs]
                b.exchange(self.ch["o"], ops)
                returns += [Payload(self.ret, g, block_parts(g, y, self.causal)[0]) for g in my_qs]
            done[c] += 1
        for p in returns:
            b.reduce(p)

    def post(self, t: PartnerTask, my_qs: list[int], offsets: list[int]) -> None:
        lay, x = self.lay, self.x
        y = lay.rank(lay.node(x), t.peer_local)
        peer_qs = self.qsets(y, offsets)
        if t.exchange_kv:
            ops = [
                send(y, Kind.KV, x, self.kv_part(peer_qs, x)),
                recv(y, Kind.KV, y, self.kv_part(my_qs, y)),
            ]
            self.b.exchange(self.ch["kv"], ops)
        else:
            ops = [send(y, self.qkind, g, block_parts(g, y, self.causal)[0]) for g in my_qs]
            ops += [recv(y, self.qkind, g, block_parts(g, x, self.causal)[0]) for g in peer_qs]
            self.b.exchange(self.ch["q"], ops)


def pipeline_program(
    cp_rank: int, layout: Layout, causal: bool, cfg: PipelineConfig, backward: bool
) -> Program:
    return _Pass(cp_rank, layout, causal, cfg, backward).build()
