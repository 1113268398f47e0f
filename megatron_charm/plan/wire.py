"""The planner's rule for the precision each partial result travels in.

Note [Wire precision]
~~~~~~~~~~~~~~~~~~~~~
A partial result (output with its lse, dq, dk/dv) that holds exactly one block travels as the
kernel produced it, in the input dtype: upcasting it would only add bytes. A partial that merged
two or more blocks is float32, and travels so, except on the channels that the options make
compact (``cross_return="input"``: charm's node-merged returns cross nodes in the input dtype, one
more rounding for half the bytes on the slow link). A partial of one head group that goes to its
owner (``a2a``, ``a2a+p2p``) is complete for its heads (the validator checks it): the owner only
places it into its head slice and casts the result to the input dtype, so it travels in the input
dtype at no cost in precision. Inputs (q, kv, the backward bundle) always travel in the input dtype.

Programs are built without precisions. :func:`own_wires` decides them for one rank from its own
program alone: a send from the rank's accumulator history, a receive from the sender's count
that the schedule generator put on the op (``Op.held``). So a rank of a large group plans only
itself (:func:`megatron_charm.plan.rank_plan`), and both sides still allocate the same buffer:
the validator checks that every send meets a receive of the same precision, and the tests check
that :func:`own_wires` equals :func:`assign_wires` on every rank. :func:`assign_wires` is the
global rule: it decides each send from the sender's history and copies it to the matching receive
(the ``i``-th send of a payload from ``x`` to ``y`` on a channel meets the ``i``-th such receive).
It serves plans pruned to a mask, whose pruning changes what senders hold after the generators
ran.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import replace

from megatron_charm.plan.types import Compute, Exchange, Heads, Kind, Merge, Op, Program, Wire

AccKey = tuple[Kind, int, Heads | None]


def _compute_keys(ins: Compute, backward: bool) -> list[AccKey]:
    """The accumulators a block adds to: its output (forward), its dq and dk/dv (backward)."""
    if backward:
        return [(Kind.DQ, ins.q_owner, ins.heads), (Kind.DKV, ins.kv_owner, ins.heads)]
    return [(Kind.O, ins.q_owner, ins.heads)]


def sent_counts(prog: Program, backward: bool) -> dict[tuple[int, int], int]:
    """``(handle, op index) -> blocks`` that the accumulator of every partial ``prog`` sends
    holds when it is sent (a merged partial counts 2, whatever it held)."""
    blocks: dict[AccKey, int] = defaultdict(int)
    out: dict[tuple[int, int], int] = {}
    for ins in prog.instrs:
        if isinstance(ins, Compute):
            for key in _compute_keys(ins, backward):
                blocks[key] += 1
        elif isinstance(ins, Merge):
            blocks[(ins.payload.kind, ins.payload.owner, ins.payload.heads)] += 2
        elif isinstance(ins, Exchange):
            for k, op in enumerate(ins.ops):
                p = op.payload
                if op.send and p.kind.is_partial:
                    out[(ins.handle, k)] = blocks.pop((p.kind, p.owner, p.heads), 0)
    return out


def placed(op: Op, me: int) -> bool:
    """Whether the partial of ``op`` (an op of rank ``me``) is a head group that goes to its
    owner complete, to be placed there (not merged: :attr:`Op.merged`)."""
    p = op.payload
    return p.heads is not None and not op.merged and (op.peer if op.send else me) == p.owner


def partial_wire(held: int, placed: bool, compact_here: bool) -> Wire:
    """Note [Wire precision] for one partial: ``held`` blocks, ``placed`` (a head group going to
    its owner), on a channel the options make compact or not."""
    return Wire.INPUT if held == 1 or placed or compact_here else Wire.FP32


def sender_wires(
    prog: Program, backward: bool, compact: frozenset[str]
) -> dict[tuple[int, int], Wire]:
    """``(handle, op index) -> Wire`` for every partial that ``prog`` sends."""
    counts, ops = sent_counts(prog, backward), {}
    for ins in prog.instrs:
        if isinstance(ins, Exchange):
            for k, op in enumerate(ins.ops):
                if (ins.handle, k) in counts:
                    ops[(ins.handle, k)] = partial_wire(
                        counts[(ins.handle, k)], placed(op, prog.cp_rank), ins.channel in compact
                    )
    return ops


def own_wires(prog: Program, backward: bool, compact: frozenset[str]) -> Program:
    """``prog`` with the wire precision of every op decided from ``prog`` alone (sends from its
    history, receives from ``Op.held``; Note [Wire precision]). Only ops whose precision differs
    from the one they carry are rebuilt (a rank of a large group has thousands of them)."""
    me, counts, instrs = prog.cp_rank, sent_counts(prog, backward), []
    for ins in prog.instrs:
        if isinstance(ins, Exchange):
            ops, changed = [], False
            for k, op in enumerate(ins.ops):
                p = op.payload
                if p.kind.is_partial:
                    held = counts[(ins.handle, k)] if op.send else op.held
                    wire = partial_wire(held, placed(op, me), ins.channel in compact)
                    if wire is not op.wire:
                        op, changed = replace(op, wire=wire), True
                ops.append(op)
            if changed:
                ins = Exchange(ins.handle, ins.channel, tuple(ops))
        instrs.append(ins)
    return Program(me, tuple(instrs))


def assign_wires(
    programs: list[Program], backward: bool, compact: frozenset[str]
) -> tuple[Program, ...]:
    """``programs`` with the wire precision of every op decided (Note [Wire precision])."""
    sent: dict[tuple, deque[Wire]] = defaultdict(deque)
    decided: list[dict[tuple[int, int], Wire]] = []
    for prog in programs:
        wires = sender_wires(prog, backward, compact)
        decided.append(wires)
        for ins in prog.instrs:
            if isinstance(ins, Exchange):
                for k, op in enumerate(ins.ops):
                    if op.send and op.payload.kind.is_partial:
                        key = (ins.channel, prog.cp_rank, op.peer, op.payload)
                        sent[key].append(wires[(ins.handle, k)])
    out = []
    for prog, wires in zip(programs, decided, strict=True):
        instrs = []
        for ins in prog.instrs:
            if isinstance(ins, Exchange) and any(op.payload.kind.is_partial for op in ins.ops):
                ops = tuple(
                    _with_wire(op, ins, k, prog.cp_rank, wires, sent)
                    for k, op in enumerate(ins.ops)
                )
                ins = replace(ins, ops=ops)
            instrs.append(ins)
        out.append(replace(prog, instrs=tuple(instrs)))
    return tuple(out)


def _with_wire(op: Op, ex: Exchange, k: int, me: int, wires, sent) -> Op:
    if not op.payload.kind.is_partial:
        return op
    if op.send:
        return replace(op, wire=wires[(ex.handle, k)])
    queue = sent.get((ex.channel, op.peer, me, op.payload))
    if not queue:
        # no matching send: leave it for the validator, which reports the schedule error
        return op
    return replace(op, wire=queue.popleft())
