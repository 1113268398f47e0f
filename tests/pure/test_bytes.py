"""Bytes per rank and channel: the planner's count against closed forms.

Units: ``c`` = half the local tokens; per token, q carries ``qe = b*h*d`` and kv
``kve = 2*b*h_kv*d`` elements of the input dtype (``E`` bytes); an lse ``b*h`` float32 values.
"""

from __future__ import annotations

import pytest

from megatron_charm.plan import AttnShape, Layout, PlanOptions, build_plan
from megatron_charm.plan.cost import plan_bytes
from megatron_charm.plan.partners import partner_tasks
from megatron_charm.plan.types import Part


def plan_of(method, layout, causal, **options):
    return build_plan(PlanOptions(method=method, **options), layout, causal)


SHAPE = AttnShape(b=2, s_local=16, h=8, h_kv=2, d=4, itemsize=2)
E = SHAPE.itemsize
C = SHAPE.s_local // 2
QE = SHAPE.b * SHAPE.h * SHAPE.d
KVE = 2 * SHAPE.b * SHAPE.h_kv * SHAPE.d
LSE = SHAPE.b * SHAPE.h * 4


def _total(per_rank: dict, channel: str) -> int:
    return sum(ch.get(channel, 0) for ch in per_rank.values())


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_ring(n, causal):
    fwd, bwd = plan_bytes(plan_of("ring", Layout(1, n), causal), SHAPE)
    for x in range(n):
        assert fwd[x] == {"full.kv": (n - 1) * 2 * C * KVE * E}
        # dkv: the first hop holds one block (input dtype), later hops are merged (float32)
        assert bwd[x] == {
            "full.kv": (n - 1) * 2 * C * KVE * E,
            "full.o": 2 * C * KVE * (E + (n - 1) * 4),
        }


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_merge_causal_sends_only_used_halves(n):
    fwd, _ = plan_bytes(plan_of("merge", Layout(1, n), True), SHAPE)
    for x in range(n):
        # to higher ranks the first half of kv, to lower ranks all of it
        assert fwd[x] == {"full.kv": ((n - 1 - x) * C + x * 2 * C) * KVE * E}


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_rmplus_totals(n):
    kv_pairs, q_pairs = n * n // 4, n * n // 4 - n // 2
    fwd, _ = plan_bytes(plan_of("rm+", Layout(1, n), False), SHAPE)
    assert _total(fwd, "full.kv") == kv_pairs * 2 * (2 * C) * KVE * E
    assert _total(fwd, "full.q") == q_pairs * 2 * (2 * C) * QE * E
    assert _total(fwd, "full.o") == q_pairs * 2 * (2 * C) * (QE * E + LSE)
    # causal: a pair moves a half one way and a whole the other way: 3c instead of 4c
    fwd, _ = plan_bytes(plan_of("rm+", Layout(1, n), True), SHAPE)
    assert _total(fwd, "full.kv") == kv_pairs * 3 * C * KVE * E
    assert _total(fwd, "full.q") == q_pairs * 3 * C * QE * E
    assert _total(fwd, "full.o") == q_pairs * 3 * C * (QE * E + LSE)


@pytest.mark.parametrize("m,p", [(1, 4), (2, 1), (2, 2), (2, 4), (4, 2), (3, 2), (8, 1)])
def test_charm_per_rank(m, p):
    fwd, _ = plan_bytes(
        plan_of(
            "charm", Layout(m, p), False, cross_level="q", cross_return="fp32", intra_level="split"
        ),
        SHAPE,
    )
    # kv moves once: later rounds (foreign query sets) reuse the kv the first round brought
    rounds = 1
    for x in range(m * p):
        tasks = partner_tasks(x % p, p, split=True)
        k = sum(t.exchange_kv for t in tasks)
        q = len(tasks) - k
        want = {
            "intra.kv": rounds * k * 2 * C * KVE * E,
            "intra.q": m * q * 2 * C * QE * E,
            "intra.o": m * q * 2 * C * (QE * E + LSE),
            "cross.q": (m - 1) * 2 * C * QE * E,
            # the foreign rank returns its node's merged output: float32 unless it is one block
            "cross.o": (m - 1) * 2 * C * (QE * (E if p == 1 else 4) + LSE),
        }
        assert fwd[x] == {ch: b for ch, b in want.items() if b}


def test_charm_keeps_kv_inside_nodes():
    for causal in (True, False):
        plan = plan_of("charm", Layout(4, 2), causal, cross_level="q")
        for prog in plan.forward + plan.backward:
            for ex in prog.exchanges():
                if ex.channel.startswith("cross"):
                    assert all(op.payload.kind.value not in ("kv", "dkv") for op in ex.ops)
                else:
                    assert all(op.peer // 2 == prog.cp_rank // 2 for op in ex.ops)


def test_input_cross_return_halves_cross_returns():
    exact, _ = plan_bytes(
        plan_of("charm", Layout(2, 2), False, cross_level="q", cross_return="fp32"), SHAPE
    )
    compact, _ = plan_bytes(
        plan_of("charm", Layout(2, 2), False, cross_level="q", cross_return="input"), SHAPE
    )
    for x in range(4):
        assert exact[x]["cross.o"] == 2 * C * (QE * 4 + LSE)
        assert compact[x]["cross.o"] == 2 * C * (QE * E + LSE)
        assert {k: v for k, v in exact[x].items() if k != "cross.o"} == {
            k: v for k, v in compact[x].items() if k != "cross.o"
        }


@pytest.mark.parametrize("m,p", [(2, 1), (2, 2), (2, 4), (4, 2), (3, 2)])
def test_charm_kv_level_per_rank(m, p):
    fwd, bwd = plan_bytes(
        plan_of(
            "charm", Layout(m, p), False, cross_level="kv", cross_return="fp32", intra_level="split"
        ),
        SHAPE,
    )
    for x in range(m * p):
        tasks = partner_tasks(x % p, p, split=True)
        k = sum(t.exchange_kv for t in tasks)
        q = len(tasks) - k
        # every round hosts own q and one kv set: own kv, then each other node's counterpart's
        # kv in two halves (two rounds, so that results of the first leave while the second
        # crosses); a partner keeps q and kv across rounds, but every round returns results
        rounds = 1 + 2 * (m - 1)
        want = {
            "intra.kv": m * k * 2 * C * KVE * E,
            "intra.q": q * 2 * C * QE * E,
            "intra.o": rounds * q * 2 * C * (QE * E + LSE),
            "cross.kv": (m - 1) * 2 * C * KVE * E,
        }
        assert fwd[x] == {ch: b for ch, b in want.items() if b}
        # backward: kv crosses again and its node-merged dk/dv return (float32 unless one block)
        assert bwd[x]["cross.kv"] == (m - 1) * 2 * C * KVE * E
        assert bwd[x]["cross.o"] == (m - 1) * 2 * C * KVE * (E if p == 1 else 4)


def _link_bytes(programs, shape):
    """``{(channel, src, dst): bytes}`` of every send in ``programs``."""
    from megatron_charm.plan.payloads import payload_bytes

    out = {}
    for prog in programs:
        for ex in prog.exchanges():
            for op in ex.ops:
                if op.send:
                    key = (ex.channel, prog.cp_rank, op.peer)
                    out[key] = out.get(key, 0) + payload_bytes(op.payload, shape, op.wire)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("causal", [True, False])
def test_all_gather_per_link(n, causal):
    plan = plan_of("all_gather", Layout(1, n), causal)
    # tokens of kv_x that y's queries see: the first half (c) when x < y under causal, else all
    seen = {(x, y): C if causal and x < y else 2 * C for x in range(n) for y in range(n)}
    kv = {("full.kv", x, y): seen[(x, y)] * KVE * E for x in range(n) for y in range(n) if x != y}
    assert _link_bytes(plan.forward, SHAPE) == kv
    # backward: kv again, and each partial dk/dv goes straight home as one block (input dtype)
    dkv = {("full.o", x, y): seen[(y, x)] * KVE * E for x in range(n) for y in range(n) if x != y}
    assert _link_bytes(plan.backward, SHAPE) == {**kv, **dkv}
    if not causal:  # the classic all-gather volume: every rank's kv to every other rank
        assert sum(kv.values()) == n * (n - 1) * 2 * C * KVE * E


RESEND_SPLITS = [(n, p) for n in range(2, 13) for p in range(2, n) if n % p == 0]


@pytest.mark.parametrize("n,p", RESEND_SPLITS, ids=[f"{n // p}x{p}" for n, p in RESEND_SPLITS])
def test_no_rank_receives_an_input_it_already_holds(n, p):
    """Within a pass a rank keeps every q and kv it received, so receiving a half of it again is
    a wasted transfer (causal charm once re-sent own kv/q whole in a later round)."""
    for level in ("q", "kv"):
        for causal in (True, False):
            plan = plan_of("charm", Layout(n // p, p), causal, cross_level=level)
            for prog in plan.forward + plan.backward:
                held: dict = {}
                for ex in prog.exchanges():
                    for op in ex.ops:
                        if op.send or op.payload.kind.is_partial:
                            continue
                        key = (op.payload.kind, op.payload.owner)
                        halves = (
                            {Part.FIRST, Part.SECOND}
                            if op.payload.part == Part.FULL
                            else {op.payload.part}
                        )
                        assert not held.get(key, set()) & halves, (level, causal, prog.cp_rank, ex)
                        held.setdefault(key, set()).update(halves)


A2A = AttnShape(b=2, s_local=16, h=8, h_kv=4, d=4, itemsize=2)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_a2a_per_link(n, causal):
    # every link carries the all-to-all volume: 1/n of the heads of every token, causal or not
    plan = plan_of("a2a", Layout(1, n), causal)
    t, q, kv, lse = 2 * C, A2A.b * A2A.h * A2A.d, 2 * A2A.b * A2A.h_kv * A2A.d, A2A.b * A2A.h * 4
    links = [(x, y) for x in range(n) for y in range(n) if x != y]
    fwd = {("full.q", x, y): t * q * E // n for x, y in links}
    fwd |= {("full.kv", x, y): t * kv * E // n for x, y in links}
    # a returned output is complete for its heads: input dtype, and its float32 lse
    fwd |= {("full.o", x, y): t * (q * E + lse) // n for x, y in links}
    assert _link_bytes(plan.forward, A2A) == fwd
    # backward: q, dout, lse and delta (Note [The backward bundle]) with kv; dq and dk/dv come
    # back in the input dtype
    bwd = {("full.q", x, y): t * (2 * q * E + 2 * lse) // n for x, y in links}
    bwd |= {("full.kv", x, y): t * kv * E // n for x, y in links}
    bwd |= {("full.o", x, y): t * (q + kv) * E // n for x, y in links}
    assert _link_bytes(plan.backward, A2A) == bwd
    # the all-to-all volume: a rank keeps 1/n of its q and kv and sends the rest
    sent = sum(v for (ch, x, _), v in fwd.items() if ch != "full.o" and x == 0)
    assert sent == (n - 1) * t * (q + kv) * E // n


@pytest.mark.parametrize("m,p", [(1, 2), (2, 2), (3, 2), (2, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_a2a_p2p_per_link(m, p, causal):
    # inside a node the all-to-all of a2a over p ranks; across nodes a ring of whole kv per step
    layout = Layout(m, p)
    plan = plan_of("a2a+p2p", layout, causal)
    t, q, kv, lse = 2 * C, A2A.b * A2A.h * A2A.d, 2 * A2A.b * A2A.h_kv * A2A.d, A2A.b * A2A.h * 4
    intra = [(x, y) for x in range(m * p) for y in range(m * p) if x != y and x // p == y // p]
    ring = [(x, (x + p) % (m * p)) for x in range(m * p)] if m > 1 else []
    fwd = {("intra.q", x, y): t * q * E // p for x, y in intra}
    fwd |= {("intra.kv", x, y): t * kv * E // p for x, y in intra}
    fwd |= {("intra.o", x, y): t * (q * E + lse) // p for x, y in intra}
    # p owners' kv at 1/p of the heads per step: one whole kv, m - 1 steps
    fwd |= {("cross.kv", x, y): (m - 1) * t * kv * E for x, y in ring}
    assert _link_bytes(plan.forward, A2A) == fwd
    bwd = {k: v for k, v in fwd.items() if k[0] in ("intra.kv", "cross.kv")}
    bwd |= {("intra.q", x, y): t * (2 * q * E + 2 * lse) // p for x, y in intra}
    bwd |= {("intra.o", x, y): t * (q + kv) * E // p for x, y in intra}
    # partial dk/dv go around the whole ring (m hops, home on the last), in float32 (p blocks or
    # more), but the one the last hop brings to its owner is complete: input dtype
    bwd |= {("cross.o", x, y): m * t * kv * 4 - t * kv * (4 - E) // p for x, y in ring}
    assert _link_bytes(plan.backward, A2A) == bwd


@pytest.mark.parametrize("m,p", [(2, 1), (2, 2), (3, 2), (2, 4)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("foreign_q", ["keep", "resend"])
def test_a2a_charm_per_link(m, p, causal, foreign_q):
    # inside a node the all-to-all of a2a+p2p; across nodes each query once to every other node
    # (the part that node's kv sees) and its partial output back, kv never (Note [A2a+charm
    # schedule]); the backward's bundle without the query when the receiver kept it
    layout = Layout(m, p)
    plan = plan_of("a2a+charm", layout, causal, foreign_q=foreign_q)
    t, q, kv, lse = 2 * C, A2A.b * A2A.h * A2A.d, 2 * A2A.b * A2A.h_kv * A2A.d, A2A.b * A2A.h * 4
    n = m * p
    intra = [(x, y) for x in range(n) for y in range(n) if x != y and x // p == y // p]
    cross = [(x, y) for x in range(n) for y in range(n) if x // p != y // p and x % p == y % p]

    def part(x, y):  # the share of x's node's queries that y's node's kv sees
        return 0.5 if causal and x // p < y // p else 1.0

    fwd = {("intra.q", x, y): t * q * E // p for x, y in intra}
    fwd |= {("intra.kv", x, y): t * kv * E // p for x, y in intra}
    fwd |= {("intra.o", x, y): t * (q * E + lse) // p for x, y in intra}
    # p members' queries at 1/p of the heads: one whole q (or its second half) per other node;
    # their outputs come back merged over the node's p kv, in the input dtype with the lse
    fwd |= {("cross.q", x, y): int(part(x, y) * t * q * E) for x, y in cross}
    fwd |= {("cross.o", x, y): int(part(y, x) * t * (q * E + lse)) for x, y in cross}
    assert _link_bytes(plan.forward, A2A) == fwd
    bwd = {k: v for k, v in fwd.items() if k[0] == "intra.kv"}
    bwd |= {("intra.q", x, y): t * (2 * q * E + 2 * lse) // p for x, y in intra}
    bwd |= {("intra.o", x, y): t * (q + kv) * E // p for x, y in intra}
    bundle = (1 if foreign_q == "keep" else 2) * q * E + 2 * lse  # [q,] dout, lse, delta
    bwd |= {("cross.q", x, y): int(part(x, y) * t * bundle) for x, y in cross}
    bwd |= {("cross.o", x, y): int(part(y, x) * t * q * E) for x, y in cross}
    assert _link_bytes(plan.backward, A2A) == bwd
    # multi-head, two nodes: a quarter less across nodes than a2a+p2p's ring under causal
    # masking (halves one way, whole the other), the same without a mask, plus the lse
    mha = AttnShape(b=2, s_local=16, h=8, h_kv=8, d=4, itemsize=2)
    ours, ring = (
        sum(v for (ch, _, _), v in _link_bytes(pl.forward, mha).items() if ch[:5] == "cross")
        for pl in (plan, plan_of("a2a+p2p", layout, causal))
    )
    lse_share = (m - 1) * n * t * mha.b * mha.h * 4 * (0.75 if causal else 1.0)
    assert ours == (0.75 if causal else 1.0) * ring + lse_share
