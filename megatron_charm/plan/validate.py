"""Symbolic replay of all ranks' programs in one process ("mailbox replay").

It proves, for a plan, before anything runs on a network:

* every (q owner, kv owner) block is computed exactly once, with the parts the layout prescribes
  (on all heads, or once on each head group of one split);
* every partial result reaches its owner and is merged exactly once (outputs, dq, dk/dv); a
  head-group partial reaches its owner only complete for its heads, and the owner ends with every
  group;
* every send meets its receive, with the same payload and wire precision, under NCCL's strictest
  rule: exchanges of one channel complete in posting order, and an exchange completes only
  together with the exchanges of its peers that hold the matching ops. A plan that passes cannot
  hang;
* with ``first_contact_blocks``, it still cannot hang when NCCL connects peers lazily (Note
  [First contact]);
* no partial travels in more bytes than it needs (one block in float32), and a merged partial
  travels in the input dtype only on a channel the options make compact;
* every rank computes the same amount of work;
* a backward bundle sent without its q (``DB``) completes a q piece that its receiver received
  in the forward from the same rank (Note [Keeping foreign queries]).

:class:`Replay` is shaped like the executor (:class:`megatron_charm.comm.executor.ProgramRunner`):
one object per rank interprets the same four instructions, on symbols instead of tensors.

Note [First contact]
~~~~~~~~~~~~~~~~~~~~
NCCL sets up the connection between two ranks of a communicator at their first send/recv, inside
``ncclGroupEnd``, and the host blocks there until the peer makes its own first exchange with it
on that communicator. Posting is then no longer free: a rank whose first exchange with ``y`` on
``intra.kv`` comes before its first with ``z`` on ``cross.q`` can wait for ``y`` while ``z`` waits
for it, a cycle that gloo (and the plain replay) never shows. ``first_contact_blocks=True``
replays that rule: a rank stops at an exchange until every peer it meets there for the first
time on that channel stands at an exchange of the same channel that names it. The topology
connects every pair of every channel group up front (``megatron_charm.comm.topology``), so
running plans meet no first contact; ``connected`` gives the replay those pairs. Without them
many plans would hang (merge and RM+ from five ranks, charm with one rank per node): the warm-up
is needed, not a precaution.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from megatron_charm.plan import compact_channels
from megatron_charm.plan.bulk import collector_paused
from megatron_charm.plan.docmask import half_blocks
from megatron_charm.plan.keep import held_input, kept_pieces, q_piece
from megatron_charm.plan.layout import balanced, block_cost, block_parts, computed_blocks
from megatron_charm.plan.types import (
    Chunk,
    Compute,
    Exchange,
    Heads,
    Kind,
    Merge,
    Part,
    Payload,
    Plan,
    Program,
    Wait,
    Wire,
    head_fraction,
)
from megatron_charm.plan.wire import placed


class ScheduleError(RuntimeError):
    """A plan violates an invariant (internal error: plans are generated, not user input)."""


Pair = tuple[int, int, Part, Part]  # (q owner, kv owner, q part, kv part) of a block (piece)
Key = tuple[Kind, int, Heads | None]  # an input or accumulator: (kind, owner, head group)


@dataclass
class _Acc:
    """A symbolic accumulator: which blocks it holds, and whether it is one computed block."""

    part: Part
    pairs: set[Pair]
    single_block: bool


@dataclass(frozen=True)
class SendRecord:
    cp_rank: int
    channel: str
    peer: int
    payload: Payload
    wire: Wire


@dataclass
class Report:
    sends: list[SendRecord] = field(default_factory=list)
    cost: dict[int, float] = field(default_factory=dict)
    blocks: dict[int, int] = field(default_factory=dict)


class _RankReplay:
    """One rank's program on symbols (the executor's four instructions)."""

    def __init__(self, replay: Replay, prog: Program) -> None:
        self.replay = replay
        self.prog = prog
        self.x = prog.cp_rank
        self.pc = 0
        qk = Kind.QB if replay.backward else Kind.Q
        self.inputs: dict[Key, Part] = {
            (qk, self.x, None): Part.FULL,
            (Kind.KV, self.x, None): Part.FULL,
        }
        self.accumulators: dict[Key, _Acc] = {}
        # (handle, peer, kind, owner, heads) -> a received partial, until merged
        self.partials: dict[tuple[int, int, Kind, int, Heads | None], _Acc] = {}
        # Note [Keeping foreign queries]: q pieces kept from the forward, by sender
        self.kept: dict[Payload, int] = {}
        if replay.backward:
            self.kept = self._forward_pieces(replay.plan.forward[self.x], kept_pieces(prog))
        self.completed: set[int] = set()
        self.waited: set[int] = set()
        self.inbox: dict[int, list[tuple[Payload, int, _Acc | None]]] = {}  # (payload, peer, msg)
        # (channel, peer) past its first contact
        self.connected: set[tuple[str, int]] = {
            (c, b if a == self.x else a) for c, a, b in replay.connected if self.x in (a, b)
        }
        self.contact: tuple[str, set[int]] | None = None  # blocked at a first contact

    def err(self, msg: str) -> ScheduleError:
        return ScheduleError(f"cp_rank {self.x}, instr {self.pc}: {msg}")

    def _forward_pieces(self, forward: Program, pieces: frozenset[Payload]) -> dict[Payload, int]:
        """The sender of each kept piece, from the forward's receives of it (exactly one)."""
        got: dict[Payload, list[int]] = {}
        for ex in forward.exchanges():
            for op in ex.ops:
                if not op.send and op.payload in pieces:
                    got.setdefault(op.payload, []).append(op.peer)
        for piece in pieces:
            if len(got.get(piece, [])) != 1:
                raise self.err(f"keeps {piece}, received {len(got.get(piece, []))} times forward")
        return {piece: peers[0] for piece, peers in got.items()}

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.prog.instrs)

    def has(self, kind: Kind, owner: int, part: Part, heads: Heads | None = None) -> bool:
        """Whether the rank holds ``part`` of the input on ``heads`` (all heads cover a group)."""
        for key in {(kind, owner, None), (kind, owner, heads)}:
            got = self.inputs.get(key)
            if got is not None and got.contains(part):
                return True
        return False

    def step(self) -> bool:
        """Run until a wait blocks or the program ends; whether anything ran."""
        moved = False
        while not self.finished:
            ins = self.prog.instrs[self.pc]
            if isinstance(ins, Wait) and ins.handle not in self.completed:
                return moved
            if isinstance(ins, Exchange) and self.replay.first_contact_blocks:
                connected, waiting = self._first_contact(ins)
                moved = moved or connected
                if waiting:
                    return moved
            getattr(self, f"_{type(ins).__name__.lower()}")(ins)
            self.pc += 1
            moved = True
        return moved

    def _first_contact(self, ex: Exchange) -> tuple[bool, bool]:
        """Note [First contact]: connect what can be connected; return (whether a connection was
        made, whether this rank still waits at ``ex``)."""
        # a bad peer is reported by _exchange, not waited for
        new = {
            op.peer
            for op in ex.ops
            if 0 <= op.peer < self.replay.n
            and op.peer != self.x
            and (ex.channel, op.peer) not in self.connected
        }
        made = False
        for y in sorted(new):
            other = self.replay.ranks[y].contact
            if other is not None and other[0] == ex.channel and self.x in other[1]:
                self.connected.add((ex.channel, y))
                self.replay.ranks[y].connected.add((ex.channel, self.x))
                made = True
        new = {y for y in new if (ex.channel, y) not in self.connected}
        self.contact = (ex.channel, new) if new else None
        return made, bool(new)

    def _exchange(self, ex: Exchange) -> None:
        messages: list[_Acc | None] = []
        compact = ex.channel in self.replay.compact
        seen: set[tuple[bool, int, Payload]] = set()
        for op in ex.ops:
            if not 0 <= op.peer < self.replay.n or op.peer == self.x:
                raise self.err(f"bad peer {op.peer}")
            # a receive is told apart by (exchange, peer, payload): a second would be ambiguous
            if (op.send, op.peer, op.payload) in seen:
                verb = "sends" if op.send else "receives"
                raise self.err(f"{verb} {op.payload} twice with cp_rank {op.peer} in one exchange")
            seen.add((op.send, op.peer, op.payload))
            if not op.send:
                if op.payload.kind is Kind.DB:
                    self._check_bundle_sender(op.payload, op.peer)
                messages.append(None)
                continue
            p = op.payload
            if p.kind.is_partial:
                acc = self.accumulators.pop((p.kind, p.owner, p.heads), None)
                if acc is None or acc.part != p.part:
                    raise self.err(f"sends {p} but holds {acc and acc.part}")
                if placed(op, self.x):
                    self._check_complete(p, acc, op.wire)
                elif acc.single_block and op.wire != Wire.INPUT:
                    raise self.err(f"sends the single block {p} in float32 (twice the bytes)")
                elif not acc.single_block and op.wire == Wire.INPUT and not compact:
                    raise self.err(f"sends the merged {p} in the input dtype on {ex.channel}")
                messages.append(acc)
            else:
                if not self.has(held_input(p.kind), p.owner, p.part, p.heads):
                    raise self.err(f"sends {p} that it does not hold")
                messages.append(None)
            self.replay.report.sends.append(SendRecord(self.x, ex.channel, op.peer, p, op.wire))
        self.inbox[ex.handle] = []
        self.replay.mailbox.post(self.x, ex, messages)

    def _check_complete(self, p: Payload, acc: _Acc, wire: Wire) -> None:
        """A head-group partial travels only complete for its heads, in the input dtype (Note
        [Wire precision])."""
        got = {(q, kv) for q, kv, _, _ in acc.pairs}
        if got != self.replay.owner_pairs(p.kind, p.owner) or acc.part != Part.FULL:
            raise self.err(f"sends the head-group partial {p} before it is complete")
        if wire != Wire.INPUT:
            raise self.err(f"sends the complete head-group partial {p} in float32")

    def _wait(self, w: Wait) -> None:
        if w.handle in self.waited:
            raise self.err(f"waits twice for {w.handle}")
        self.waited.add(w.handle)
        for payload, peer, acc in self.inbox.pop(w.handle):
            if acc is None and payload.kind is Kind.DB:
                self._complete_bundle(payload)
            elif acc is None:
                self.inputs[(payload.kind, payload.owner, payload.heads)] = payload.part
            else:
                self.partials[(w.handle, peer, payload.kind, payload.owner, payload.heads)] = acc

    def _check_bundle_sender(self, p: Payload, peer: int) -> None:
        """A ``DB`` comes from the rank that sent its q piece in the forward."""
        sender = self.kept.get(q_piece(p))
        if sender is not None and sender != peer:
            raise self.err(f"receives {p} from {peer}, but its q came from {sender} forward")

    def _complete_bundle(self, p: Payload) -> None:
        piece = q_piece(p)
        if piece not in self.kept:
            raise self.err(f"receives {p} without its q, which it did not keep")
        del self.kept[piece]
        self.inputs[(Kind.QB, p.owner, p.heads)] = p.part

    def _compute(self, c: Compute) -> None:
        replay = self.replay
        seq = replay.plan.options.seq_layout
        if (c.q_owner, c.kv_owner) not in replay.blocks:
            raise self.err(f"computes block ({c.q_owner},{c.kv_owner}), empty in the {seq} layout")
        qp, kp, masked = block_parts(c.q_owner, c.kv_owner, replay.plan.causal, seq)
        if replay.plan.pattern is not None:
            # pruned to a mask: any narrowing of the dense block that holds a non-empty half
            # block (coverage is checked per half block at the end)
            live = [hb for hb in half_blocks(c.q_part, c.kv_part) if hb in replay.live(c)]
            if masked != c.masked or not (qp.contains(c.q_part) and kp.contains(c.kv_part)):
                raise self.err(f"block ({c.q_owner},{c.kv_owner}) uses wrong parts")
            if not live:
                raise self.err(f"computes block ({c.q_owner},{c.kv_owner}), empty under the mask")
        else:
            # a block may be computed in two halves of its queries or of its keys (never the
            # masked one)
            # ... or in chunks of its keys (TASP, Note [TASP schedule])
            q_split = qp == Part.FULL and c.q_part != Part.FULL and c.kv_part == kp
            kv_split = kp.contains(c.kv_part) and c.kv_part != kp and c.q_part == qp
            whole = (c.q_part, c.kv_part) == (qp, kp)
            if masked != c.masked or not (whole or ((q_split or kv_split) and not masked)):
                raise self.err(f"block ({c.q_owner},{c.kv_owner}) uses wrong parts")
        qk = Kind.QB if replay.backward else Kind.Q
        if not self.has(qk, c.q_owner, c.q_part, c.heads):
            q = Payload(Kind.Q, c.q_owner, c.q_part, c.heads)
            raise self.err(f"computes with {q} not received")
        if not self.has(Kind.KV, c.kv_owner, c.kv_part, c.heads):
            raise self.err(
                f"computes with {Payload(Kind.KV, c.kv_owner, c.kv_part, c.heads)} not received"
            )
        pair = (c.q_owner, c.kv_owner)
        replay.pair_parts.setdefault(pair, {}).setdefault(c.heads, []).append((c.q_part, c.kv_part))
        share = (c.q_part.fraction / qp.fraction) * (c.kv_part.fraction / kp.fraction)
        share *= head_fraction(c.heads)
        report = replay.report
        report.cost[self.x] = report.cost.get(self.x, 0.0) + share * block_cost(
            *pair, replay.plan.causal, seq
        )
        report.blocks[self.x] = report.blocks.get(self.x, 0) + 1
        block = {(*pair, c.q_part, c.kv_part)}
        if replay.backward:
            self._add((Kind.DQ, c.q_owner, c.heads), c.q_part, block, True)
            self._add((Kind.DKV, c.kv_owner, c.heads), c.kv_part, block, True)
        else:
            self._add((Kind.O, c.q_owner, c.heads), c.q_part, block, True)

    def _merge(self, m: Merge) -> None:
        p = m.payload
        acc = self.partials.pop((m.handle, m.peer, p.kind, p.owner, p.heads), None)
        if acc is None:
            raise self.err(
                f"merges {p} from cp_rank {m.peer} by exchange {m.handle}, which it has not "
                "received"
            )
        if acc.part != p.part:
            raise self.err(f"merges {p} but received part {acc.part}")
        self._add((p.kind, p.owner, p.heads), acc.part, acc.pairs, False)

    def _add(self, key: Key, part: Part, pairs: set[Pair], computed: bool) -> None:
        acc = self.accumulators.get(key)
        if acc is None:
            self.accumulators[key] = _Acc(part, set(pairs), computed and len(pairs) == 1)
            return
        twice = [
            (q, kv)
            for q, kv, qp, kp in pairs
            for q2, kv2, qp2, kp2 in acc.pairs
            if (q, kv) == (q2, kv2)
            and (qp.contains(qp2) or qp2.contains(qp))
            and (kp.contains(kp2) or kp2.contains(kp))
        ]
        if twice:
            raise self.err(f"accumulator {key} merges blocks {sorted(twice)} twice")
        acc.pairs |= pairs
        acc.part = acc.part.union(part)
        acc.single_block = False


class _Mailbox:
    """Channel FIFOs of posted exchanges and the NCCL-strict matching between them."""

    def __init__(self) -> None:
        self.fifo: dict[tuple[int, str], deque[Exchange]] = {}
        self.messages: dict[tuple[int, int], list[_Acc | None]] = {}

    def post(self, cp_rank: int, ex: Exchange, messages: list[_Acc | None]) -> None:
        self.fifo.setdefault((cp_rank, ex.channel), deque()).append(ex)
        self.messages[(cp_rank, ex.handle)] = messages

    def heads(self) -> dict[tuple[int, str], Exchange]:
        return {k: q[0] for k, q in self.fifo.items() if q}

    @staticmethod
    def _matches(x: int, ex: Exchange, heads: dict[tuple[int, str], Exchange]) -> bool:
        """Whether every peer's head exchange on the channel holds ops matching ``ex``'s."""
        for op in ex.ops:
            other = heads.get((op.peer, ex.channel))
            if other is None:
                return False
            want = [(o.payload, o.wire) for o in other.ops if o.peer == x and o.send != op.send]
            mine = [(o.payload, o.wire) for o in ex.ops if o.peer == op.peer and o.send == op.send]
            if want != mine:
                if want:
                    raise ScheduleError(
                        f"channel {ex.channel}: cp_rank {x} posts "
                        f"{[f'{p}/{w.value}' for p, w in mine]} with {op.peer}, which posts "
                        f"{[f'{p}/{w.value}' for p, w in want]}"
                    )
                return False
        return True

    def ready(self) -> tuple[dict[tuple[int, str], Exchange], set[tuple[int, str]]]:
        """Head exchanges that complete now: matched, together with all their peers' heads."""
        heads = self.heads()
        ready = {k for k, ex in heads.items() if self._matches(k[0], ex, heads)}
        changed = True
        while changed:
            changed = False
            for k in list(ready):
                if any((op.peer, k[1]) not in ready for op in heads[k].ops):
                    ready.discard(k)
                    changed = True
        return heads, ready

    def deliver(self, ranks: list[_RankReplay]) -> bool:
        """Complete every ready exchange; whether any completed."""
        heads, ready = self.ready()
        for x, channel in ready:
            ex = self.fifo[(x, channel)].popleft()
            replay = ranks[x]
            replay.completed.add(ex.handle)
            for op in ex.ops:
                if op.send:
                    continue
                peer_ex = heads[(op.peer, channel)]
                idx = next(
                    i
                    for i, o in enumerate(peer_ex.ops)
                    if o.send and o.peer == x and o.payload == op.payload
                )
                msg = self.messages[(op.peer, peer_ex.handle)][idx]
                replay.inbox[ex.handle].append((op.payload, op.peer, msg))
        return bool(ready)


class Replay:
    """Replays one pass of a plan for all ranks; :meth:`run` raises :class:`ScheduleError` on any
    violation and returns the sends and the work per rank."""

    def __init__(
        self,
        plan: Plan,
        backward: bool,
        first_contact_blocks: bool = False,
        connected: Iterable[tuple[str, int, int]] = (),
    ) -> None:
        self.plan = plan
        self.backward = backward
        self.first_contact_blocks = first_contact_blocks
        self.connected = tuple(connected)
        progs = plan.programs(backward)
        self.n = len(progs)
        self.compact = compact_channels(plan.options)
        self.report = Report()
        self.mailbox = _Mailbox()
        # (q owner, kv owner) -> head group -> the (q part, kv part) pieces computed
        self.pair_parts: dict[tuple[int, int], dict[Heads | None, list[tuple[Part, Part]]]] = {}
        self.blocks = computed_blocks(self.n, plan.causal, plan.options.seq_layout)
        # pruned plans: (q owner, kv owner) -> its non-empty (q half, kv half) blocks
        self.want: dict[tuple[int, int], set[tuple[Part, Part]]] = {}
        if plan.pattern is not None:
            for x, a, y, b in plan.pattern:
                self.want.setdefault((x, y), set()).add((a, b))
            self.blocks = set(self.want)
        self.ranks = [_RankReplay(self, p) for p in progs]

    def live(self, c: Compute) -> set[tuple[Part, Part]]:
        """``(q half, kv half)`` of the block of ``c`` that the plan's mask leaves non-empty."""
        return self.want.get((c.q_owner, c.kv_owner), set())

    def owner_pairs(self, kind: Kind, owner: int) -> set[tuple[int, int]]:
        """The blocks a complete partial of ``kind`` of ``owner`` holds."""
        if kind == Kind.DKV:
            return {(q, owner) for q in range(self.n) if (q, owner) in self.blocks}
        return {(owner, y) for y in range(self.n) if (owner, y) in self.blocks}

    def run(self) -> Report:
        while True:
            moved = any([r.step() for r in self.ranks])
            delivered = self.mailbox.deliver(self.ranks)
            if not moved and not delivered:
                break
        stuck = [r for r in self.ranks if not r.finished]
        if stuck:
            detail = "; ".join(self._blocked(r) for r in stuck[:4])
            raise ScheduleError(f"deadlock: {len(stuck)} rank(s) blocked: {detail}")
        for r in self.ranks:
            if r.kept:
                raise ScheduleError(f"cp_rank {r.x} keeps {sorted(map(str, r.kept))} unused")
        self._final_checks()
        return self.report

    @staticmethod
    def _blocked(r: _RankReplay) -> str:
        if r.contact is None:
            return f"cp_rank {r.x} at {r.prog.instrs[r.pc]}"
        channel, peers = r.contact
        return (
            f"cp_rank {r.x} at its first exchange with cp_rank(s) {sorted(peers)} on {channel}, "
            "which never reach theirs (NCCL connects lazily and blocks the host until both "
            "sides arrive; see Note [First contact])"
        )

    def _check_masked_cover(self) -> None:
        """Pruned plans: every non-empty half block is computed exactly once per head group."""
        want = self.want
        for pair, by_heads in self.pair_parts.items():
            for heads, parts in by_heads.items():
                got = [hb for q, k in parts for hb in half_blocks(q, k) if hb in want.get(pair, ())]
                if len(got) != len(set(got)) or set(got) != want[pair]:
                    raise ScheduleError(_cover_error(pair, heads, got, want[pair]))

    def _final_checks(self) -> None:
        n, causal, seq = self.n, self.plan.causal, self.plan.options.seq_layout
        halves = sorted([Part.FIRST, Part.SECOND])
        if self.plan.pattern is not None:
            self._check_masked_cover()
        for pair, by_heads in self.pair_parts.items():
            if self.plan.pattern is not None:
                if not _all_heads(by_heads):
                    raise ScheduleError(f"block {pair} computed on head groups {_groups(by_heads)}")
                continue
            qp, kp, _ = block_parts(*pair, causal, seq)
            tilings = [
                [(qp, kp)],
                sorted((h, kp) for h in halves),
                sorted((qp, h) for h in halves),
            ]
            counts = {k.count for _, k in _flat(by_heads) if type(k) is Chunk and k.base is kp}
            tilings += [[(qp, Chunk(kp, i, count)) for i in range(count)] for count in counts]
            tilings = [sorted(t, key=_labels) for t in tilings]
            if not _all_heads(by_heads):
                raise ScheduleError(f"block {pair} computed on head groups {_groups(by_heads)}")
            for heads, parts in by_heads.items():
                if sorted(parts, key=_labels) not in tilings:
                    shown = [f"{q.value}x{k.value}" for q, k in parts]
                    raise ScheduleError(f"block {pair} on heads {heads} computed as {shown}")
        if len(self.pair_parts) != len(self.blocks):
            raise ScheduleError(f"{len(self.blocks) - len(self.pair_parts)} blocks never computed")
        for r in self.ranks:
            if r.partials:
                raise ScheduleError(
                    f"cp_rank {r.x} received partials it never merged: {list(r.partials)}"
                )
            kinds = (Kind.DQ, Kind.DKV) if self.backward else (Kind.O,)
            want = {(kind, r.x): self.owner_pairs(kind, r.x) for kind in kinds}
            groups: dict[tuple[Kind, int], dict[Heads | None, _Acc]] = {}
            for (kind, owner, heads), a in r.accumulators.items():
                groups.setdefault((kind, owner), {})[heads] = a
            got = {
                (k, h): {(q, kv) for q, kv, _, _ in a.pairs}
                for k, accs in groups.items()
                for h, a in accs.items()
            }
            wrong = {f"{k}/{h}": sorted(v) for (k, h), v in got.items() if want.get(k) != v}
            if wrong or set(groups) != set(want):
                raise ScheduleError(f"cp_rank {r.x} ends with wrong accumulators: {wrong}")
            for k, accs in groups.items():
                if not _all_heads(accs):
                    raise ScheduleError(f"cp_rank {r.x} ends {k} with head groups {_groups(accs)}")
                for h, a in accs.items():
                    if a.part != Part.FULL:
                        raise ScheduleError(f"cp_rank {r.x} accumulator {k}/{h} covers {a.part}")
        costs = {x: round(self.report.cost.get(x, 0.0), 9) for x in range(n)}
        even = balanced(causal, seq) and self.plan.pattern is None
        if len(set(costs.values())) > 1 and even:
            raise ScheduleError(f"unbalanced work: {costs}")


def _cover_error(pair: tuple[int, int], heads: Heads | None, got: list, want: set) -> str:
    shown = sorted(f"{a.value}x{b.value}" for a, b in got)
    return f"block {pair} on heads {heads} covers non-empty half blocks {shown}, want {want}"


def _all_heads(by_heads: dict) -> bool:
    """Whether the keys of ``by_heads`` are all heads (``None``) or every group of one split."""
    if set(by_heads) == {None}:
        return True
    counts = {h.count for h in by_heads if h is not None}
    if None in by_heads or len(counts) != 1:
        return False
    (count,) = counts
    return set(by_heads) == {Heads(i, count) for i in range(count)}


def _groups(by_heads: dict) -> list[str]:
    return sorted(str(h) for h in by_heads)


def _flat(by_heads: dict) -> list[tuple[Part, Part | Chunk]]:
    """Every ``(q part, kv part)`` computed for a block, on any head group."""
    return [qk for parts in by_heads.values() for qk in parts]


def _labels(qk: tuple[Part, Part | Chunk]) -> tuple[str, str]:
    """A sort key for ``(q part, kv part)`` pairs that mix parts and chunks."""
    return qk[0].value, qk[1].value


def replay(
    plan: Plan,
    backward: bool = False,
    first_contact_blocks: bool = False,
    connected: Iterable[tuple[str, int, int]] = (),
) -> Report:
    """Replay one pass of ``plan``; raise :class:`ScheduleError` on any violation.

    ``first_contact_blocks``: model NCCL's lazy connections (Note [First contact]);
    ``connected``: ``(channel, cp_rank, cp_rank)`` pairs already connected before the pass (a
    warm-up's), which then never block.
    """
    return Replay(plan, backward, first_contact_blocks, connected).run()


def validate(
    plan: Plan, first_contact_blocks: bool = False, connected: Iterable[tuple[str, int, int]] = ()
) -> tuple[Report, Report]:
    """Replay forward and backward (options as :func:`replay`); return their reports."""
    pairs = tuple(connected)
    with collector_paused():  # Note [Pausing the cyclic collector]
        return (
            replay(plan, False, first_contact_blocks, pairs),
            replay(plan, True, first_contact_blocks, pairs),
        )
