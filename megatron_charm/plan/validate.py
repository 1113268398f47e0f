"""Symbolic replay of all ranks' programs in one process ("mailbox simulation").

It proves, for a plan, before anything runs on a network:

* every (q owner, kv owner) block is computed exactly once, with the parts the layout prescribes;
* every partial result reaches its owner and is merged exactly once (outputs, dq, dk/dv);
* every send meets its receive, with the same payload, under NCCL's strictest rule: exchanges of
  one channel complete in posting order, and an exchange completes only together with the
  exchanges of its peers that hold the matching ops. A plan that passes cannot hang;
* every rank computes the same amount of work.

It also records each send with its wire precision, from which :func:`bytes_sent` counts bytes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from megatron_charm.plan.layout import block_cost, block_parts
from megatron_charm.plan.types import Compute, Exchange, Kind, Part, Payload, Plan, Program, Reduce


class ScheduleError(RuntimeError):
    """A plan violates an invariant (internal error: plans are generated, not user input)."""


@dataclass
class _Acc:
    part: Part
    pairs: set[tuple[int, int, Part]]  # (q owner, kv owner, q part) of every block merged in
    from_compute: bool


@dataclass(frozen=True)
class SendRecord:
    cp_rank: int
    channel: str
    peer: int
    payload: Payload
    raw: bool  # a single block result travels in the input dtype; merged partials in float32


@dataclass
class Report:
    sends: list[SendRecord] = field(default_factory=list)
    cost: dict[int, float] = field(default_factory=dict)
    blocks: dict[int, int] = field(default_factory=dict)
    # (cp_rank, handle, op index) -> whether that partial travels in the input dtype
    raw: dict[tuple[int, int, int], bool] = field(default_factory=dict)


class _Rank:
    def __init__(self, prog: Program, bwd: bool):
        self.prog = prog
        self.x = prog.cp_rank
        self.pc = 0
        self.bwd = bwd
        qk = Kind.QB if bwd else Kind.Q
        self.avail: dict[tuple[Kind, int], Part] = {
            (qk, self.x): Part.FULL,
            (Kind.KV, self.x): Part.FULL,
        }
        self.accs: dict[tuple[Kind, int], _Acc] = {}
        self.partials: dict[tuple[int, Kind, int], _Acc] = {}
        self.done_handles: set[int] = set()
        self.waited: set[int] = set()
        self.inbox: dict[int, list[tuple[Payload, _Acc | None]]] = {}

    def err(self, msg: str) -> ScheduleError:
        return ScheduleError(f"cp_rank {self.x}, instr {self.pc}: {msg}")


def _add(acc_map, key, part, pairs, from_compute, r: _Rank) -> None:
    acc = acc_map.get(key)
    if acc is None:
        acc_map[key] = _Acc(part, set(pairs), from_compute)
        return
    twice = [
        (q, kv)
        for q, kv, part in pairs
        for q2, kv2, part2 in acc.pairs
        if (q, kv) == (q2, kv2) and (part.contains(part2) or part2.contains(part))
    ]
    if twice:
        raise r.err(f"accumulator {key} merges blocks {sorted(twice)} twice")
    acc.pairs |= pairs
    acc.part = acc.part.union(part)
    acc.from_compute = False


def simulate(plan: Plan, backward: bool = False) -> Report:
    """Replay one pass of ``plan``; raise :class:`ScheduleError` on any violation."""
    progs = plan.backward if backward else plan.forward
    n = len(progs)
    ranks = [_Rank(p, backward) for p in progs]
    fifo: dict[tuple[int, str], deque[Exchange]] = {}
    pair_parts: dict[tuple[int, int], list[Part]] = {}
    report = Report()
    qk = Kind.QB if backward else Kind.Q

    def have(r: _Rank, kind: Kind, owner: int, part: Part) -> bool:
        got = r.avail.get((kind, owner))
        return got is not None and got.contains(part)

    def step(r: _Rank) -> bool:
        moved = False
        while r.pc < len(r.prog.instrs):
            ins = r.prog.instrs[r.pc]
            if isinstance(ins, Exchange):
                msgs = []
                for k, op in enumerate(ins.ops):
                    if not 0 <= op.peer < n or op.peer == r.x:
                        raise r.err(f"bad peer {op.peer}")
                    if op.send:
                        p = op.payload
                        if p.kind.is_partial:
                            acc = r.accs.pop((p.kind, p.owner), None)
                            if acc is None or acc.part != p.part:
                                raise r.err(f"sends {p} but holds {acc and acc.part}")
                            raw = (acc.from_compute and len(acc.pairs) == 1) or (
                                ins.channel in plan.compact_channels
                            )
                            report.raw[(r.x, ins.handle, k)] = raw
                            msgs.append(acc)
                        else:
                            if not have(r, p.kind, p.owner, p.part):
                                raise r.err(f"sends {p} that it does not hold")
                            raw = True
                            msgs.append(None)
                        report.sends.append(SendRecord(r.x, ins.channel, op.peer, p, raw))
                    else:
                        msgs.append(None)
                r.inbox[ins.handle] = []
                fifo.setdefault((r.x, ins.channel), deque()).append(ins)
                ins_msgs[(r.x, ins.handle)] = msgs
            elif hasattr(ins, "handle") and not isinstance(ins, Reduce):  # Wait
                if ins.handle not in r.done_handles:
                    return moved
                if ins.handle in r.waited:
                    raise r.err(f"waits twice for {ins.handle}")
                r.waited.add(ins.handle)
                for payload, acc in r.inbox.pop(ins.handle):
                    if acc is None:
                        r.avail[(payload.kind, payload.owner)] = payload.part
                    else:
                        r.partials[(ins.handle, payload.kind, payload.owner)] = acc
            elif isinstance(ins, Compute):
                qp, kp, masked = block_parts(ins.q_owner, ins.kv_owner, plan.causal)
                # a block may be computed in two halves of its queries (never the masked one)
                split = qp == Part.FULL and ins.q_part != Part.FULL and not masked
                if (kp, masked) != (ins.kv_part, ins.masked) or not (ins.q_part == qp or split):
                    raise r.err(f"block ({ins.q_owner},{ins.kv_owner}) uses wrong parts")
                if not have(r, qk, ins.q_owner, ins.q_part):
                    raise r.err(f"computes with q{ins.q_owner}.{ins.q_part.value} not received")
                if not have(r, Kind.KV, ins.kv_owner, ins.kv_part):
                    raise r.err(f"computes with kv{ins.kv_owner}.{ins.kv_part.value} not received")
                pair = (ins.q_owner, ins.kv_owner)
                pair_parts.setdefault(pair, []).append(ins.q_part)
                share = ins.q_part.fraction / qp.fraction
                report.cost[r.x] = report.cost.get(r.x, 0.0) + share * block_cost(
                    *pair, plan.causal
                )
                report.blocks[r.x] = report.blocks.get(r.x, 0) + 1
                if backward:
                    _add(r.accs, (Kind.DQ, ins.q_owner), ins.q_part, {(*pair, ins.q_part)}, True, r)
                    _add(
                        r.accs,
                        (Kind.DKV, ins.kv_owner),
                        ins.kv_part,
                        {(*pair, ins.q_part)},
                        True,
                        r,
                    )
                else:
                    _add(r.accs, (Kind.O, ins.q_owner), ins.q_part, {(*pair, ins.q_part)}, True, r)
            elif isinstance(ins, Reduce):
                p = ins.payload
                acc = r.partials.pop((ins.handle, p.kind, p.owner), None)
                if acc is None:
                    raise r.err(f"reduces {p} from exchange {ins.handle} it has not received")
                if acc.part != p.part:
                    raise r.err(f"reduces {p} but received part {acc.part}")
                _add(r.accs, (p.kind, p.owner), acc.part, acc.pairs, False, r)
            r.pc += 1
            moved = True
        return moved

    ins_msgs: dict[tuple[int, int], list[_Acc | None]] = {}

    def heads() -> dict[tuple[int, str], Exchange]:
        return {k: q[0] for k, q in fifo.items() if q}

    def counterpart_ok(x: int, ex: Exchange, hd: dict[tuple[int, str], Exchange]) -> bool:
        for op in ex.ops:
            other = hd.get((op.peer, ex.channel))
            if other is None:
                return False
            want = [o for o in other.ops if o.peer == x and o.send != op.send]
            mine = [o for o in ex.ops if o.peer == op.peer and o.send == op.send]
            if [o.payload for o in want] != [o.payload for o in mine]:
                if want:
                    raise ScheduleError(
                        f"channel {ex.channel}: cp_rank {x} posts {[str(o.payload) for o in mine]} "
                        f"with {op.peer}, which posts {[str(o.payload) for o in want]}"
                    )
                return False
        return True

    while True:
        moved = any([step(r) for r in ranks])
        hd = heads()
        ready = {k for k, ex in hd.items() if counterpart_ok(k[0], ex, hd)}
        changed = True
        while changed:
            changed = False
            for k in list(ready):
                ex = hd[k]
                if any((op.peer, ex.channel) not in ready for op in ex.ops):
                    ready.discard(k)
                    changed = True
        for x, ch in ready:
            ex = fifo[(x, ch)].popleft()
            r = ranks[x]
            r.done_handles.add(ex.handle)
            for k, op in enumerate(ex.ops):
                if op.send:
                    continue
                peer_ex = hd[(op.peer, ch)]
                idx = next(
                    i
                    for i, o in enumerate(peer_ex.ops)
                    if o.send and o.peer == x and o.payload == op.payload
                )
                msg = ins_msgs[(op.peer, peer_ex.handle)][idx]
                if op.payload.kind.is_partial:
                    report.raw[(x, ex.handle, k)] = report.raw[(op.peer, peer_ex.handle, idx)]
                r.inbox[ex.handle].append((op.payload, msg))
        if not moved and not ready:
            break
    stuck = [r.x for r in ranks if r.pc < len(r.prog.instrs)]
    if stuck:
        detail = "; ".join(f"cp_rank {x} at {ranks[x].prog.instrs[ranks[x].pc]}" for x in stuck[:4])
        raise ScheduleError(f"deadlock: {len(stuck)} rank(s) blocked: {detail}")
    _final_checks(plan, ranks, pair_parts, report, backward)
    return report


def _final_checks(plan: Plan, ranks: list[_Rank], pair_parts, report: Report, backward: bool):
    n = len(ranks)
    for pair, parts in pair_parts.items():
        whole = block_parts(*pair, plan.causal)[0]
        if sorted(parts) != sorted([whole]) and sorted(parts) != sorted([Part.FIRST, Part.SECOND]):
            raise ScheduleError(f"block {pair} computed as {[p.value for p in parts]}")
    if len(pair_parts) != n * n:
        raise ScheduleError(f"{n * n - len(pair_parts)} blocks never computed")
    for r in ranks:
        if r.partials:
            raise ScheduleError(
                f"cp_rank {r.x} received partials it never merged: {list(r.partials)}"
            )
        if backward:
            want = {
                (Kind.DQ, r.x): {(r.x, y) for y in range(n)},
                (Kind.DKV, r.x): {(q, r.x) for q in range(n)},
            }
        else:
            want = {(Kind.O, r.x): {(r.x, y) for y in range(n)}}
        got = {k: {(q, kv) for q, kv, _ in a.pairs} for k, a in r.accs.items()}
        if got != want:
            extra = {k: sorted(v) for k, v in got.items() if want.get(k) != v}
            raise ScheduleError(f"cp_rank {r.x} ends with wrong accumulators: {extra}")
        for k, a in r.accs.items():
            if a.part != Part.FULL:
                raise ScheduleError(f"cp_rank {r.x} accumulator {k} covers only {a.part}")
    costs = {x: round(report.cost.get(x, 0.0), 9) for x in range(n)}
    if len(set(costs.values())) > 1:
        raise ScheduleError(f"unbalanced work: {costs}")


def validate(plan: Plan) -> tuple[Report, Report]:
    """Simulate forward and backward; return their reports."""
    return simulate(plan, backward=False), simulate(plan, backward=True)
