"""Prune a dense plan to a mask: no compute, transfer or merge for what the mask empties (pure).

Note [Pruning to a mask]
~~~~~~~~~~~~~~~~~~~~~~~~
A mask empties some half blocks ``(q cp_rank, q half, kv cp_rank, kv half)`` (its *pattern* of
non-empty ones, :mod:`megatron_charm.plan.docmask`). Any method's dense plan covers every half
block once, so the pruned plan is the dense one with everything the mask makes useless removed,
for every method alike::

    1. computes     narrow each Compute to the halves that hold non-empty blocks; drop it if none
    2. partials     forward flow: an accumulator is live in the parts its computes and merges
                    gave it; a partial send of a dead accumulator goes, with its receive and Merge
    3. inputs       backward flow: a delivery of q/kv (or the backward bundle) is live in the
                    parts that its later computes and onward sends use; a send is live in what
                    its receiver's delivery needs, and shrinks to it
    4. exchanges    drop the empty ones and their waits

Steps 2 and 3 cross ranks (a send's liveness is its peer's), so each runs to a fixpoint over all
ranks, revisiting only ranks whose peers changed what they send or need; liveness only grows, so
it ends. The ``i``-th send of a payload from ``x`` to ``y`` on a
channel meets the ``i``-th such receive (as in :mod:`megatron_charm.plan.wire`). Nothing is
reordered, so a dense plan that cannot hang gives a pruned plan that cannot either: every kept
receive meets its kept send, and the validator replays the result anyway.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from megatron_charm.plan.docmask import half_blocks
from megatron_charm.plan.mask import BlockKey
from megatron_charm.plan.types import (
    Compute,
    Exchange,
    Heads,
    Kind,
    Merge,
    Op,
    Part,
    Program,
    Wait,
)

OpId = tuple[int, int, int]  # (cp_rank, exchange handle, op index)
Key = tuple[Kind, int, Heads | None]


def _union(a: Part | None, b: Part | None) -> Part | None:
    if a is None:
        return b
    if b is None:
        return a
    return a.union(b)


def _parts(halves: set[Part]) -> Part | None:
    if not halves:
        return None
    return halves.pop() if len(halves) == 1 else Part.FULL


def narrow(c: Compute, pattern: frozenset[BlockKey]) -> Compute | None:
    """``c`` restricted to the halves that hold non-empty blocks of ``pattern``, or ``None``."""
    live = [
        (a, b)
        for a, b in half_blocks(c.q_part, c.kv_part)
        if (c.q_owner, a, c.kv_owner, b) in pattern
    ]
    if not live:
        return None
    q_part = _parts({a for a, _ in live})
    kv_part = _parts({b for _, b in live})
    assert q_part is not None and kv_part is not None
    return replace(c, q_part=q_part, kv_part=kv_part)


def _pairing(programs: Sequence[Program]) -> dict[OpId, OpId]:
    """Send op <-> receive op, both ways."""
    sends: dict[tuple, list[OpId]] = defaultdict(list)
    recvs: dict[tuple, list[OpId]] = defaultdict(list)
    for prog in programs:
        x = prog.cp_rank
        for ins in prog.instrs:
            if not isinstance(ins, Exchange):
                continue
            for k, op in enumerate(ins.ops):
                if op.send:
                    sends[(x, op.peer, ins.channel, op.payload)].append((x, ins.handle, k))
                else:
                    recvs[(op.peer, x, ins.channel, op.payload)].append((x, ins.handle, k))
    pair: dict[OpId, OpId] = {}
    for key, ids in sends.items():
        got = recvs.get(key, [])
        assert len(got) == len(ids), f"unmatched sends of {key}"
        for s, r in zip(ids, got, strict=True):
            pair[s], pair[r] = r, s
    return pair


def _compute_keys(c: Compute, backward: bool) -> list[tuple[Key, Part]]:
    if backward:
        return [
            ((Kind.DQ, c.q_owner, c.heads), c.q_part),
            ((Kind.DKV, c.kv_owner, c.heads), c.kv_part),
        ]
    return [((Kind.O, c.q_owner, c.heads), c.q_part)]


def _fixpoint(programs: Sequence[Program], visit) -> None:
    """Run ``visit(prog) -> ranks to revisit`` until no rank has a changed input.

    Sweeps alternate direction, so that a chain that flows along a ring in either direction
    settles in a few sweeps, and only ranks whose inputs changed are visited again."""
    dirty = {p.cp_rank for p in programs}
    by_rank = {p.cp_rank: p for p in programs}
    order = sorted(by_rank)
    while dirty:
        for x in order:
            if x in dirty:
                dirty.discard(x)
                dirty |= visit(by_rank[x])
        order.reverse()


def _partial_parts(
    programs: Sequence[Program], backward: bool, pair: dict[OpId, OpId]
) -> dict[OpId, Part | None]:
    """Forward flow: the part each partial send carries (``None``: nothing, drop it)."""
    sent: dict[OpId, Part | None] = {}

    def visit(prog: Program) -> set[int]:
        x, wake = prog.cp_rank, set()
        acc: dict[Key, Part | None] = {}
        got: dict[tuple[int, int, Key], Part | None] = {}  # (handle, peer, key)
        for ins in prog.instrs:
            if isinstance(ins, Compute):
                for key, part in _compute_keys(ins, backward):
                    acc[key] = _union(acc.get(key), part)
            elif isinstance(ins, Merge):
                p = ins.payload
                key = (p.kind, p.owner, p.heads)
                acc[key] = _union(acc.get(key), got.pop((ins.handle, ins.peer, key), None))
            elif isinstance(ins, Exchange):
                for k, op in enumerate(ins.ops):
                    p = op.payload
                    if not p.kind.is_partial:
                        continue
                    key = (p.kind, p.owner, p.heads)
                    me = (x, ins.handle, k)
                    if op.send:
                        part = acc.pop(key, None)
                        if sent.get(me) != part:
                            sent[me] = part
                            wake.add(op.peer)
                    else:
                        got[(ins.handle, op.peer, key)] = sent.get(pair[me])
        return wake

    _fixpoint(programs, visit)
    return sent


def _input_parts(
    programs: Sequence[Program], backward: bool, pair: dict[OpId, OpId]
) -> dict[OpId, Part | None]:
    """Backward flow: the part each input receive must deliver (``None``: drop it)."""
    qkind = Kind.QB if backward else Kind.Q
    delivered: dict[OpId, Part | None] = {}

    def visit(prog: Program) -> set[int]:
        x, wake = prog.cp_rank, set()
        exchanges = {i.handle: i for i in prog.instrs if isinstance(i, Exchange)}
        need: dict[Key, Part | None] = {}
        for ins in reversed(prog.instrs):
            if isinstance(ins, Compute):
                for key, part in (
                    ((qkind, ins.q_owner, ins.heads), ins.q_part),
                    ((Kind.KV, ins.kv_owner, ins.heads), ins.kv_part),
                ):
                    need[key] = _union(need.get(key), part)
            elif isinstance(ins, Exchange):
                for k, op in enumerate(ins.ops):
                    p = op.payload
                    if op.send and not p.kind.is_partial:
                        key = (p.kind, p.owner, p.heads)
                        want = delivered.get(pair[(x, ins.handle, k)])
                        need[key] = _union(need.get(key), want)
            elif isinstance(ins, Wait):
                ex = exchanges[ins.handle]
                for k, op in enumerate(ex.ops):
                    p = op.payload
                    if op.send or p.kind.is_partial:
                        continue
                    # a delivery serves the uses after it, until the next delivery
                    keys = [(p.kind, p.owner, p.heads)]
                    if p.heads is None:
                        keys += [q for q in need if q[:2] == (p.kind, p.owner) and q[2]]
                    part = None
                    for key in keys:
                        part = _union(part, need.pop(key, None))
                    if delivered.get((x, ex.handle, k)) != part:
                        delivered[(x, ex.handle, k)] = part
                        wake.add(op.peer)
        return wake

    _fixpoint(programs, visit)
    return delivered


def prune_programs(
    programs: Sequence[Program], backward: bool, pattern: frozenset[BlockKey]
) -> list[Program]:
    """The programs of one pass pruned to ``pattern`` (Note [Pruning to a mask]); ``programs``
    have no wire precisions yet (:func:`megatron_charm.plan.wire.assign_wires` runs after)."""
    narrowed = [
        Program(
            p.cp_rank,
            tuple(
                c
                for c in (narrow(i, pattern) if isinstance(i, Compute) else i for i in p.instrs)
                if c is not None
            ),
        )
        for p in programs
    ]
    pair = _pairing(narrowed)
    partial = _partial_parts(narrowed, backward, pair)
    inputs = _input_parts(narrowed, backward, pair)

    def part_of(x: int, handle: int, k: int, op: Op) -> Part | None:
        me = (x, handle, k)
        if op.payload.kind.is_partial:
            return partial.get(me if op.send else pair[me])
        return inputs.get(pair[me] if op.send else me)

    out = []
    for prog in narrowed:
        x = prog.cp_rank
        kept: list = []
        dropped: set[int] = set()
        merges: dict[tuple[int, int, Key], Part] = {}  # (handle, peer, key)
        for ins in prog.instrs:
            if isinstance(ins, Exchange):
                ops = []
                for k, op in enumerate(ins.ops):
                    part = part_of(x, ins.handle, k, op)
                    if part is None:
                        continue
                    p = op.payload
                    ops.append(replace(op, payload=replace(p, part=part)))
                    if p.kind.is_partial and not op.send:
                        merges[(ins.handle, op.peer, (p.kind, p.owner, p.heads))] = part
                if ops:
                    kept.append(replace(ins, ops=tuple(ops)))
                else:
                    dropped.add(ins.handle)
            elif isinstance(ins, Wait):
                if ins.handle not in dropped:
                    kept.append(ins)
            elif isinstance(ins, Merge):
                p = ins.payload
                part = merges.get((ins.handle, ins.peer, (p.kind, p.owner, p.heads)))
                if part is not None:
                    kept.append(replace(ins, payload=replace(p, part=part)))
            else:
                kept.append(ins)
        out.append(Program(x, tuple(kept)))
    return out


__all__ = ["narrow", "prune_programs"]
