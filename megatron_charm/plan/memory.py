"""What a pass holds, from its program alone (pure; no torch).

Note [Memory of a pass]
~~~~~~~~~~~~~~~~~~~~~~~
The executor allocates, beyond the caller's tensors, five kinds of buffers, each with a lifetime
that the program fixes (no timing enters):

    received input   Wait ............................ its last use (release_points)
    receive buffer   Exchange ........ Wait                (then an input or a partial)
    send copy        Exchange ........ Wait                (casts, head slices, popped results)
    accumulator      first Compute/Merge ............. sent, or the end of the pass
    partial          Wait ............ Merge
    expanded kv      first Compute ................... last Compute (GQA without native GQA)

A run of computes that the executor does as one call (Note [Coalesced blocks] in
:mod:`megatron_charm.plan.coalesce`) counts as one instruction: each of its query and kv pieces
updates its accumulator once, and the inputs whose last use lies inside the run are released at
its end.

:func:`pass_memory` replays a program over these rules and returns the largest total after any
instruction, the number that the executor's ``peak_buffer_bytes`` reports for the same program
(the gloo tier checks the two are equal). So memory is a property of the plan, like bytes: a
planner change can be judged, and tested, without running a kernel.

Foreign q pieces kept for the backward (Note [Keeping foreign queries] in
:mod:`megatron_charm.plan.keep`) live from their forward ``Wait`` to the end of the forward, then
from the start of the backward to the ``Wait`` of the ``DB`` that completes their bundle.

Assumptions, as in the executor: the caller's q, k, v (and the backward's dout, lse and delta) are
contiguous ``[s, b, h, d]`` (``sbhd``; ``bshd`` callers pay layout copies outside these
buffers); a single computed block is kept in the input dtype (``Accumulator.single_block``) and
a second contribution makes the accumulator float32 over the union of the parts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megatron_charm.plan.coalesce import steps
from megatron_charm.plan.keep import held_input, kept_pieces, q_piece
from megatron_charm.plan.payloads import AttnShape, group_heads, payload_bytes
from megatron_charm.plan.types import (
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
)

Key = tuple[Kind, int, Heads | None]  # (kind, owner, head group; None: all heads)
ExpandKey = tuple[int, Heads | None]  # (kv owner, head group)


def release_points(program: Program, own: set[Key], backward: bool) -> dict[int, list[Key]]:
    """Instruction index -> received input keys whose last use is that instruction.

    A key can be received again later (CHARM+ rounds fetch kv anew); each delivery starts a new
    lifetime that ends at its last use before the next delivery. Head groups of an input in
    ``own`` are views of it and never released.
    """
    qkind = Kind.QB if backward else Kind.Q
    own_inputs = {(kind, owner) for kind, owner, _ in own}
    last: dict[Key, int] = {}
    out: dict[int, list[Key]] = defaultdict(list)
    recv_keys: dict[int, list[Key]] = {}
    for i, ins in enumerate(program.instrs):
        if isinstance(ins, Exchange):
            recv_keys[ins.handle] = [
                (held_input(op.payload.kind), op.payload.owner, op.payload.heads)
                for op in ins.ops
                if not op.send and not op.payload.kind.is_partial
            ]
            used = [
                (held_input(op.payload.kind), op.payload.owner, op.payload.heads)
                for op in ins.ops
                if op.send and not op.payload.kind.is_partial
            ]
        elif isinstance(ins, Wait):
            for key in recv_keys.get(ins.handle, []):
                if key in last:
                    out[last.pop(key)].append(key)
            used = recv_keys.get(ins.handle, [])
        elif isinstance(ins, Compute):
            used = [(qkind, ins.q_owner, ins.heads), (Kind.KV, ins.kv_owner, ins.heads)]
        else:
            used = []
        for key in used:
            if key[:2] not in own_inputs:
                last[key] = i
    for key, i in last.items():
        out[i].append(key)
    return out


def expansion_drops(program: Program) -> dict[int, list[ExpandKey]]:
    """Instruction index -> (kv owner, head group) whose head-expanded kv is last used there.

    Note [GQA expansion] (:mod:`megatron_charm.comm.executor`): each delivery of a kv block is
    expanded at its first compute and dropped after its last compute before the block is
    delivered again.
    """
    last: dict[ExpandKey, int] = {}
    out: dict[int, list[ExpandKey]] = defaultdict(list)
    recv_kv: dict[int, list[ExpandKey]] = {}
    for i, ins in enumerate(program.instrs):
        if isinstance(ins, Exchange):
            recv_kv[ins.handle] = [
                (op.payload.owner, op.payload.heads)
                for op in ins.ops
                if not op.send and op.payload.kind == Kind.KV
            ]
        elif isinstance(ins, Wait):
            for owner in recv_kv.get(ins.handle, []):
                if owner in last:
                    out[last.pop(owner)].append(owner)
        elif isinstance(ins, Compute):
            last[(ins.kv_owner, ins.heads)] = i
    for owner, i in last.items():
        out[i].append(owner)
    return out


def own_keys(cp_rank: int, backward: bool) -> set[Key]:
    """The inputs a rank holds before a pass: its q (backward: its bundle) and its kv."""
    return {(Kind.QB if backward else Kind.Q, cp_rank, None), (Kind.KV, cp_rank, None)}


@dataclass
class _Acc:
    part: Part
    single: bool  # one computed block, kept in the input dtype
    nbytes: int


class _Replay:
    def __init__(
        self,
        program: Program,
        shape: AttnShape,
        backward: bool,
        expand: bool,
        kept: frozenset[Payload],
    ):
        self.prog, self.shape, self.backward, self.expand = program, shape, backward, expand
        self.keep = kept
        # kept foreign q pieces (Note [Keeping foreign queries]) -> bytes; the backward starts
        # with all of them
        self.kept: dict[Payload, int] = {}
        if backward:
            self.kept = {p: payload_bytes(p, shape, Wire.INPUT) for p in kept}
        # the bytes of every buffer below, kept current at each change (a sum over the held
        # buffers after every step would make a pass's replay quadratic in its length)
        self.held = sum(self.kept.values())
        # received inputs (own ones are the caller's): key -> (part held, bytes)
        self.inputs: dict[Key, tuple[Part, int]] = {}
        self.pending: dict[int, int] = {}  # handle -> receive buffers + send copies
        # handle -> (payload, peer, bytes) of each receive
        self.received: dict[int, list[tuple[Payload, int, int]]] = {}
        self.accs: dict[Key, _Acc] = {}
        self.partials: dict[tuple[int, int, Key], int] = {}  # (handle, peer, key) -> bytes
        self.expanded: dict[ExpandKey, int] = {}

    def _acc_bytes(self, key: Key, part: Part, single: bool) -> int:
        kind, _, heads = key
        wire = Wire.INPUT if single else Wire.FP32
        return payload_bytes(Payload(kind, 0, part, heads), self.shape, wire)

    def _add(self, key: Key, part: Part, computed: bool) -> None:
        acc = self.accs.get(key)
        if acc is None:
            acc = self.accs[key] = _Acc(part, computed, self._acc_bytes(key, part, computed))
            self.held += acc.nbytes
        elif acc.single or not acc.part.contains(part):
            acc.part, acc.single = acc.part.union(part), False
            nbytes = self._acc_bytes(key, acc.part, False)
            self.held += nbytes - acc.nbytes
            acc.nbytes = nbytes

    def _send_copy(self, payload: Payload) -> int:
        """Bytes a non-partial send copies: a head group sliced from an all-heads tensor is
        strided, so ``contiguous()`` copies it (a received head group is already contiguous; a
        ``DB`` is cut from the received ``QB``)."""
        heads = payload.heads
        if heads is None or (held_input(payload.kind), payload.owner, heads) in self.inputs:
            return 0
        tokens, b = self.shape.tokens(payload.part), self.shape.b
        if heads.count == 1 or tokens * b == 1:
            return 0
        return payload_bytes(payload, self.shape, Wire.INPUT)

    def step(self, run: list) -> None:
        """One step of :func:`steps`: an instruction, or a run that one operation does (as the
        executor's runner takes it)."""
        ins = run[0]
        if isinstance(ins, Exchange):
            total, recvs = 0, []
            for op in ins.ops:
                p = op.payload
                if op.send and p.kind.is_partial:
                    acc = self.accs.pop((p.kind, p.owner, p.heads))
                    assert acc.part == p.part, (self.prog.cp_rank, p, acc.part)
                    self.held -= acc.nbytes
                    total += payload_bytes(p, self.shape, op.wire)
                elif op.send:
                    total += self._send_copy(p)
                else:
                    nbytes = payload_bytes(p, self.shape, op.wire)
                    total += nbytes
                    recvs.append((p, op.peer, nbytes))
            assert ins.handle not in self.pending, (self.prog.cp_rank, ins.handle)
            self.pending[ins.handle] = total
            self.held += total
            self.received[ins.handle] = recvs
        elif isinstance(ins, Wait):
            self.held -= self.pending.pop(ins.handle)
            for p, peer, nbytes in self.received.pop(ins.handle):
                key = (p.kind, p.owner, p.heads)
                if p.kind.is_partial:
                    self.partials[(ins.handle, peer, key)] = nbytes
                    self.held += nbytes
                elif p.kind is Kind.DB:
                    kept = self.kept.pop(q_piece(p))
                    self.held -= kept
                    self._hold_input((Kind.QB, p.owner, p.heads), p.part, nbytes + kept)
                elif p in self.keep and not self.backward:
                    # held here until the backward, not by the input
                    self.held += nbytes - self.kept.get(p, 0)
                    self.kept[p] = nbytes
                    self._hold_input(key, p.part, 0)
                else:
                    self._hold_input(key, p.part, nbytes)
                    if p.kind == Kind.KV:
                        self.drop_expanded((p.owner, p.heads))
        elif isinstance(ins, Compute):
            self.computes(run)
        else:
            self.merges(run)

    def merges(self, run: list[Merge]) -> None:
        """One merge, or a run of them that one sum folds in (Note [Summed partials]): the
        accumulator is updated once, and the run's partials are gone at its end."""
        p = run[0].payload
        key = (p.kind, p.owner, p.heads)
        for m in run:
            assert isinstance(m, Merge) and m.payload == p, (self.prog.cp_rank, m)
            self.held -= self.partials.pop((m.handle, m.peer, key))
        self._add(key, p.part, False)

    def computes(self, run: list[Compute]) -> None:
        """One kernel call: a block, or a run of them (Note [Coalesced blocks]), which updates
        each query piece's and each kv piece's accumulator once."""
        for c in run:
            if self.expand and (c.kv_owner, c.heads) not in self.expanded:
                nbytes = self.expanded[(c.kv_owner, c.heads)] = self._expanded_bytes(c)
                self.held += nbytes
        q_parts = {(c.q_owner, c.heads): c.q_part for c in run}
        kv_parts = {(c.kv_owner, c.heads): c.kv_part for c in run}
        # a piece that met several blocks joins its accumulator as a merged partial (float32)
        for (owner, heads), part in q_parts.items():
            key = (Kind.DQ if self.backward else Kind.O, owner, heads)
            self._add(key, part, len(kv_parts) == 1)
        if self.backward:
            for (owner, heads), part in kv_parts.items():
                self._add((Kind.DKV, owner, heads), part, len(q_parts) == 1)

    def _expanded_bytes(self, c: Compute) -> int:
        """k and v of the kv set as held here, repeated to the group's query heads."""
        got = self.inputs.get((Kind.KV, c.kv_owner, c.heads))
        got = got or self.inputs.get((Kind.KV, c.kv_owner, None))
        held = Part.FULL if got is None else got[0]  # own kv is held whole
        h = group_heads(self.shape, c.heads)[0]
        return 2 * self.shape.tokens(held) * self.shape.b * h * self.shape.d * self.shape.itemsize

    def _hold_input(self, key: Key, part: Part, nbytes: int) -> None:
        # release_points ends a delivery's lifetime before the next delivery's Wait (at the
        # latest at its own Wait, when nothing used it)
        assert key not in self.inputs, (self.prog.cp_rank, key)
        self.held += nbytes
        self.inputs[key] = (part, nbytes)

    def release_input(self, key: Key) -> None:
        old = self.inputs.pop(key, None)
        if old is not None:
            self.held -= old[1]

    def drop_expanded(self, key: ExpandKey) -> None:
        self.held -= self.expanded.pop(key, 0)

    def recount(self) -> int:
        """:attr:`held` summed afresh over every buffer (the tests hold the two equal)."""
        return (
            sum(b for _, b in self.inputs.values())
            + sum(self.pending.values())
            + sum(a.nbytes for a in self.accs.values())
            + sum(self.partials.values())
            + sum(self.expanded.values())
            + sum(self.kept.values())
        )


def pass_memory(
    program: Program,
    shape: AttnShape,
    backward: bool,
    expand: bool = False,
    kept: frozenset[Payload] = frozenset(),
    coalesce: bool = True,
) -> int:
    """Peak bytes that one rank's pass allocates beyond the caller's tensors (Note [Memory of a
    pass]); ``shape``: the rank's local problem; ``expand``: the kernel lacks native GQA and
    the executor repeats kv heads (Note [GQA expansion]); ``kept``: the foreign q pieces kept
    for the backward (:func:`megatron_charm.plan.keep.kept_pieces` of the rank's backward);
    ``coalesce``: the executor runs products of blocks as one call (Note [Coalesced blocks];
    not under a document mask)."""
    own = own_keys(program.cp_rank, backward)
    release = release_points(program, own, backward)
    drops = expansion_drops(program) if expand else {}
    run = _Replay(program, shape, backward, expand, kept)
    peak, instrs = 0, program.instrs
    for i, end in steps(instrs, coalesce):
        run.step(list(instrs[i:end]))
        peak = max(peak, run.held)
        for j in range(i, end):
            for key in release.get(j, ()):
                run.release_input(key)
            for owner in drops.get(j, ()):
                run.drop_expanded(owner)
    assert not run.pending and not run.partials, f"cp_rank {program.cp_rank}: unfinished pass"
    assert not (backward and run.kept), f"cp_rank {program.cp_rank}: kept q never used"
    return peak


def saved_bytes(shape: AttnShape) -> int:
    """What autograd keeps from the forward for the backward beyond q, k, v: out ``[s, b, h,
    d]`` in the input dtype and the float32 lse ``[s, b, h]``."""
    return payload_bytes(Payload(Kind.O, 0, Part.FULL), shape, Wire.INPUT)


def attention_memory(
    forward: Program, backward: Program, shape: AttnShape, expand: bool = False
) -> dict[str, int]:
    """One rank's attention memory: ``fwd`` and ``bwd`` pass peaks, ``saved`` (out, lse),
    ``kept`` (foreign q pieces held between the passes, counted in both peaks: Note [Keeping
    foreign queries]) and ``peak = max(fwd, saved + bwd)``, as ``megatron-charm-bench memory``
    reports them."""
    kept = kept_pieces(backward)
    fwd = pass_memory(forward, shape, False, expand, kept)
    bwd = pass_memory(backward, shape, True, expand, kept)
    saved = saved_bytes(shape)
    held = sum(payload_bytes(p, shape, Wire.INPUT) for p in kept)
    return {"fwd": fwd, "bwd": bwd, "saved": saved, "kept": held, "peak": max(fwd, saved + bwd)}


def plan_peak(plan: Plan, shape: AttnShape) -> int:
    """The largest rank's :func:`attention_memory` ``peak`` over a whole plan, in bytes."""
    return max(
        attention_memory(f, b, shape)["peak"]
        for f, b in zip(plan.forward, plan.backward, strict=True)
    )
