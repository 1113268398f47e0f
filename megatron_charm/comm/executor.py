"""Runs one rank's program on tensors with torch.distributed point-to-point ops.

The same code serves gloo (CPU) and NCCL (GPU): exchanges are ``batch_isend_irecv`` groups on the
channel's process group, and ``Work.wait()`` is the only synchronisation (on CUDA it makes the
current stream wait for the transfer; the host does not block). Nothing here calls
``torch.cuda.synchronize``. Every tensor of an exchange, sent or received, stays referenced until
its ``Wait``: on NCCL a send buffer must outlive the transfer, and its last Python reference must
not be the only thing that keeps the caching allocator from reusing it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from megatron_charm.comm.buffers import Accumulator, TensorSpace, part_of
from megatron_charm.comm.derived import pass_steps
from megatron_charm.comm.topology import CPTopology
from megatron_charm.kernels import BlockKernel
from megatron_charm.kernels.delta import out_for_delta
from megatron_charm.kernels.heads import expand_kv_heads, fold_kv_heads
from megatron_charm.kernels.masked import masked_backward, masked_forward
from megatron_charm.plan.coalesce import run_goes_on
from megatron_charm.plan.docmask import MaskModel
from megatron_charm.plan.keep import held_input, q_piece
from megatron_charm.plan.memory import ExpandKey, Key
from megatron_charm.plan.payloads import group_heads
from megatron_charm.plan.types import (
    Compute,
    Exchange,
    Heads,
    Kind,
    Merge,
    Part,
    Payload,
    Program,
    Wait,
)

Tensor = torch.Tensor
E = TypeVar("E")  # what names an exchange in run_batches: the plan's Exchange, or a label


@dataclass
class RunStats:
    """What one pass moved and held; filled by the executor when the pass is traced.

    ``peak_buffer_bytes`` is the largest total, after any instruction, of what the pass allocates
    beyond the caller's tensors: received inputs still to be used, receive buffers in flight,
    send tensors made for an exchange (casts, copies, popped accumulators) until its wait,
    accumulators, received partials and head-expanded kv copies (Note [GQA expansion]).
    """

    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak_buffer_bytes: int = 0


@dataclass
class RunTrace:
    """One pass as seen by the optional instrumentation (``trace=`` of ``cp_attention``).

    ``events`` holds ``(instruction kind, channel or "", start, end)`` with host
    ``time.perf_counter()`` seconds; on CUDA they are host enqueue times, not device times.
    Instruction kinds are the plan's class names: ``Exchange``, ``Wait``, ``Compute``, ``Merge``.
    """

    cp_rank: int
    backward: bool
    stats: RunStats
    events: list[tuple[str, str, float, float]]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cat(tensors: list[Tensor]) -> Tensor:
    """Tensors joined along the tokens (dim 0); a single one as it is."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _split(t: Tensor, sizes: list[int], kept: bool) -> list[Tensor]:
    """``t`` cut along the tokens. ``kept``: accumulators keep the pieces as they are (one
    block each), so each gets storage of its own, and releasing one frees its bytes."""
    if len(sizes) == 1:
        return [t]
    return [p.clone() if kept else p for p in t.split(sizes)]


def run_batches(staged: Sequence[tuple[E, list, list]]) -> list[tuple[E, list]]:
    """``(exchange, ops)`` batches that post ``staged`` (a run of exchanges posted back to back,
    each as ``(exchange, receives, sends)``): one exchange as one batch, its receives first;
    several, every receive of the run, then every send, each in program order (Note [Receives
    of a run first]). Receives from one peer on one channel must keep their order: gloo
    matches them to the peer's sends in posting order."""
    if len(staged) > 1:
        out = [(ex, recvs) for ex, recvs, _ in staged if recvs]
        return out + [(ex, sends) for ex, _, sends in staged if sends]
    ((ex, recvs, sends),) = staged
    return [(ex, recvs + sends)] if recvs or sends else []


class DistributedError(RuntimeError):
    """A peer failed or timed out during a CP attention exchange."""


class ProgramRunner:
    """Interprets a :class:`Program` for one pass.

    ``inputs`` maps ``(kind, owner, None)`` to ``(part, tensors)`` for the inputs this rank
    holds on all heads (its own q/kv, or its backward bundle); received inputs join them as their
    exchanges complete and leave after their last use. With ``trace`` (a list), the pass appends
    one :class:`RunTrace` with its timeline, bytes and peak buffer bytes; without it, nothing is
    measured. With ``mask`` (a document mask resolved for the CP group), every compute runs the
    spans the mask leaves in its block (:mod:`megatron_charm.kernels.masked`) instead of the
    layout's causal rule. ``kept`` (Note [Keeping foreign queries]): in the forward, the foreign
    q pieces to keep (``Kind.Q`` payloads; the runner's ``kept`` maps each to its received
    ``[s_part, b, h, d]`` tensor at the end); in the backward, that mapping, consumed by the
    ``DB`` receives. ``own_out`` (backward): the caller's final ``out [s, b, h, d]`` of this
    rank's queries, which its own blocks give the kernel in place of the stand-in built from
    ``delta`` (Note [The backward bundle]).

    Note [GQA expansion]
    ~~~~~~~~~~~~~~~~~~~~
    With fewer kv heads than query heads and a kernel without native GQA
    (``kernel.native_gqa(device, dtype)`` false), a kernel would repeat the kv heads for every
    block it computes, and a kv block serves several computes. The runner repeats each delivered
    kv block once instead, at its first compute, hands the kernel ``h`` heads, folds the kv
    gradients of each block back to ``h_kv`` heads, and drops the copy after the block's last
    compute (:func:`expansion_drops`); the copies count in ``peak_buffer_bytes``. A kernel with
    native GQA always gets ``h_kv`` heads.
    """

    def __init__(
        self,
        topo: CPTopology,
        program: Program,
        space: TensorSpace,
        kernel: BlockKernel,
        scale: float,
        backward: bool,
        inputs: dict[Key, tuple[Part, list[Tensor]]],
        trace: list[RunTrace] | None = None,
        mask: MaskModel | None = None,
        kept: frozenset[Payload] | dict[Payload, Tensor] = frozenset(),
        own_out: Tensor | None = None,
    ) -> None:
        self.topo = topo
        self.own_out = own_out
        self.mask = mask
        self.prog = program
        self.space = space
        self.kernel = kernel
        self.scale = scale
        self.backward = backward
        self.inputs = inputs
        self.trace = trace
        self.keep = frozenset() if backward else frozenset(kept)
        self.kept: dict[Payload, Tensor] = dict(kept) if backward else {}
        self.accumulators: dict[Key, Accumulator] = {}
        # handle -> (works, received (payload, sender's cp_rank, buffers), sent tensors, bytes of
        # the sent tensors that this pass allocated): all kept until the Wait
        self.pending: dict[int, tuple[list, list, list[Tensor], int]] = {}
        # exchanges built but not yet posted: (exchange, receives, sends), posted together at
        # the end of their run (Note [Receives of a run first])
        self.staged: list[tuple[Exchange, list, list]] = []
        self.runs_receives_first = topo.receives_first_in_runs
        # (handle, peer, kind, owner, heads) -> a received partial, until merged
        self.partials: dict[
            tuple[int, int, Kind, int, Heads | None], tuple[Part, list[Tensor]]
        ] = {}
        self.exchanges: dict[int, Exchange] = {}
        self.stats = RunStats()
        shape = space.shape
        self.expand = shape.h != shape.h_kv and not kernel.native_gqa(space.device, space.dtype)
        # (kv owner, head group) -> k, v [s, b, heads, d] as held, with the group's query heads
        self.expanded: dict[ExpandKey, list[Tensor]] = {}

    def _held(self, kind: Kind, owner: int, heads: Heads | None) -> tuple[Part, list[Tensor]]:
        """The held tensors of an input restricted to ``heads`` (a view of all heads if held)."""
        held = self.inputs.get((kind, owner, heads))
        if held is not None:
            return held
        held = self.inputs.get((kind, owner, None))
        if held is None or heads is None:
            raise AssertionError(f"cp_rank {self.prog.cp_rank} lacks {kind.value}{owner}/{heads}")
        return held[0], [t[:, :, heads.of(t.shape[2])] for t in held[1]]

    def _input(self, kind: Kind, owner: int, part: Part, heads: Heads | None) -> list[Tensor]:
        held, tensors = self._held(kind, owner, heads)
        if not held.contains(part):
            raise AssertionError(
                f"cp_rank {self.prog.cp_rank} lacks {kind.value}{owner}.{part.value}"
            )
        return [part_of(t, held, part, self.space.shape.s_local) for t in tensors]

    def _accumulator(self, kind: Kind, owner: int, heads: Heads | None) -> Accumulator:
        acc = self.accumulators.get((kind, owner, heads))
        if acc is None:
            acc = self.accumulators[(kind, owner, heads)] = Accumulator(kind, self.space, heads)
        return acc

    def _exchange(self, ex: Exchange) -> None:
        """Build ``ex``'s receive buffers and send tensors and stage them for :meth:`_post`
        (Note [Receives first], Note [Receives of a run first])."""
        group = self.topo.channel(ex.channel)
        sends, recvs, received, sent = [], [], [], []
        allocated = 0  # bytes of sent tensors that exist only for this exchange
        self.exchanges[ex.handle] = ex
        for op in ex.ops:
            p = op.payload
            peer = self.topo.global_ranks[op.peer]
            if op.send:
                if p.kind.is_partial:
                    acc = self.accumulators.pop((p.kind, p.owner, p.heads))
                    assert acc.part == p.part
                    tensors = acc.to_wire(op.wire)
                    allocated += _nbytes(tensors)
                else:
                    views = self._input(held_input(p.kind), p.owner, p.part, p.heads)
                    if p.kind is Kind.DB:
                        views = views[1:]  # dout, lse, delta: the peer kept the q
                    tensors = [t.contiguous() for t in views]
                    allocated += sum(
                        _nbytes([t])
                        for t, v in zip(tensors, views, strict=True)
                        if t.data_ptr() != v.data_ptr()
                    )
                sent += tensors
                sends += [dist.P2POp(dist.isend, t, peer, group) for t in tensors]
            else:
                bufs = self.space.receive_buffers(p, op.wire)
                recvs += [dist.P2POp(dist.irecv, t, peer, group) for t in bufs]
                received.append((p, op.peer, bufs))
        if self.trace is not None:
            self.stats.bytes_sent[ex.channel] += _nbytes(sent)
        self.pending[ex.handle] = ([], received, sent, allocated)
        self.staged.append((ex, recvs, sends))

    def _post(self) -> None:
        """Post the staged exchanges in :func:`run_batches` order (Note [Receives first], Note
        [Receives of a run first])."""
        staged, self.staged = self.staged, []
        for ex, ops in run_batches(staged):
            try:
                self.pending[ex.handle][0].extend(dist.batch_isend_irecv(ops))
            except RuntimeError as exc:
                raise self._failure(ex, exc) from exc

    # Note [Receives first]
    # ~~~~~~~~~~~~~~~~~~~~~
    # gloo issues a batch's ops in list order. When two ranks swap tensors over one TCP
    # connection and each posts its send before its receive, a message that arrives before its
    # receive is posted held up the opposite direction: on the testbed at 50 Mbit/s, 1 MiB each
    # way took twice the one-way time in 7 of 8 tries (the two directions ran one after the
    # other), and at most 1.35x with the receives posted first (scripts/bench/gloo_swap.py).
    # NCCL runs a batch as one group, so the order changes nothing there.

    # Note [Receives of a run first]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The same holds across exchanges. A run of exchanges posted back to back (all_gather's
    # offsets, an all-to-all's peers) sends to x + o at offset o and receives from x + o only at
    # offset n - o: on gloo that send goes out before the receive of the opposite direction of
    # its connection is posted, and the two directions then often run one after the other. On
    # the 2 x 4 rails testbed at 100 Mbit/s, all_gather's seven exchanges of 0.5 MiB each took
    # 200-327 ms (medians 245, 231) posted one by one and 171-192 ms (medians 177, 174; the
    # link time is 169) with every receive of the run posted first (scripts/bench/gloo_swap.py
    # --run, docs/results/executor/gloo-run-2x4-rails-100mbit.txt). So on gloo
    # (CPTopology.receives_first_in_runs) the runner stages the exchanges of a run and posts
    # every receive of the run, then every send, each in program order (run_batches):
    #
    #     program    post A (->1, <-3) | post B (->3, <-1) | compute ...
    #     gloo       [<-3 of A] [<-1 of B] [->1 of A] [->3 of B] | compute ...
    #     NCCL       [<-3, ->1 of A] [<-1, ->3 of B]             | compute ...
    #
    # The receives must keep their program order: gloo matches a pair's receives on one
    # channel to the peer's sends in posting order, so moving one receive ahead of an earlier
    # one from the same peer mismatches them. A rule that posted only the receives from a
    # send's peer ahead of it did that on grouped-query a2a+p2p (gloo aborted: "Received data
    # size doesn't match expected size"; with equal sizes the data would have been swapped);
    # tests/gloo/test_nccl_path.py checks the order on such plans. Measured on the attention,
    # back to back on 2 x 2 at 50 Mbit/s: charm's forward 214-218 -> 177-180 ms, all_gather's
    # 428 -> 358 (its slow mode gone), ring's unchanged (no runs), a2a's 181-194 -> 193-201:
    # its sends to every peer now share the cross link, so no owner's inputs come in ahead of
    # the others (the replay predicts the forward+backward's loss, Note [Runs posted together] in
    # megatron_charm/sim/engine.py; docs/results/calibrated-2x2.md).
    #
    # NCCL keeps one group per exchange: a group of receives alone would hold its stream until
    # the peer's matching sends, which that peer posts only in a later group.

    def _failure(self, ex: Exchange, exc: BaseException) -> DistributedError:
        peers = sorted({op.peer for op in ex.ops})
        return DistributedError(
            f"CP attention exchange on channel {ex.channel} between cp_rank {self.prog.cp_rank} "
            f"and cp_rank(s) {peers} failed: {exc}. A peer rank died, timed out (timeout "
            f"{self.topo.timeout}), or runs a different method/shape"
        )

    def _wait(self, w: Wait) -> None:
        works, received, _sent, _ = self.pending.pop(w.handle)
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise self._failure(self.exchanges[w.handle], exc) from exc
        for p, src, bufs in received:
            if p.kind.is_partial:
                self.partials[(w.handle, src, p.kind, p.owner, p.heads)] = (p.part, bufs)
            elif p.kind is Kind.DB:
                q = self.kept.pop(q_piece(p))
                self.inputs[(Kind.QB, p.owner, p.heads)] = (p.part, [q, *bufs])
            else:
                if p in self.keep:
                    self.kept[p] = bufs[0]
                self.inputs[(p.kind, p.owner, p.heads)] = (p.part, bufs)
                if p.kind == Kind.KV:
                    self.expanded.pop((p.owner, p.heads), None)

    def _kv(self, owner: int, part: Part, heads: Heads | None) -> list[Tensor]:
        """k, v of ``owner`` restricted to ``part`` and ``heads``, with the group's query heads
        when the runner expands (Note [GQA expansion])."""
        views = self._input(Kind.KV, owner, part, heads)
        if not self.expand:
            return views
        held, tensors = self._held(Kind.KV, owner, heads)
        full = self.expanded.get((owner, heads))
        if full is None:
            h = group_heads(self.space.shape, heads)[0]
            full = self.expanded[(owner, heads)] = [expand_kv_heads(t, h) for t in tensors]
        return [part_of(t, held, part, self.space.shape.s_local) for t in full]

    def _out(
        self, q_owner: int, q_part: Part, heads: Heads | None, dout: Tensor, delta: Tensor
    ) -> Tensor:
        """What the kernel gets as ``out`` of a query piece: the caller's own ``out``, or a
        stand-in with the bundle's row sums (Note [The backward bundle])."""
        own = self.own_out
        if own is None or q_owner != self.prog.cp_rank:
            return out_for_delta(dout, delta)
        if heads is not None:
            own = own[:, :, heads.of(own.shape[2])]
        return part_of(own, Part.FULL, q_part, self.space.shape.s_local)

    def _compute(self, run: list[Compute]) -> None:
        """One kernel call: a single block, or blocks forming a product of unmasked blocks
        (Note [Coalesced blocks]) with out/lse or dq split per query piece and dk/dv per kv
        piece. Only a single block is causal or runs under a document mask."""
        first, heads = run[0], run[0].heads
        assert len(run) == 1 or not (first.masked or self.mask is not None), "masked run"
        q_parts = {c.q_owner: c.q_part for c in run}
        kv_parts = {c.kv_owner: c.kv_part for c in run}
        qkind = Kind.QB if self.backward else Kind.Q
        q_in = [self._input(qkind, z, part, heads) for z, part in q_parts.items()]
        kv_in = [self._kv(y, part, heads) for y, part in kv_parts.items()]
        q_sizes = [t[0].shape[0] for t in q_in]
        kv_sizes = [t[0].shape[0] for t in kv_in]
        k, v = (_cat([t[i] for t in kv_in]) for i in (0, 1))
        spans = None
        if self.mask is not None:
            c, half = first, self.space.shape.s_local // 2
            spans = self.mask.spans(c.q_owner, c.q_part, c.kv_owner, c.kv_part, half)
        # a piece that met several blocks holds a merged result, which the plan's wires carry
        # in float32 (Note [Wire precision]): it joins its accumulator as a merged partial does
        one_block_q, one_block_kv = len(kv_parts) == 1, len(q_parts) == 1
        if not self.backward:
            q = _cat([t[0] for t in q_in])
            if spans is None:
                out, lse = self.kernel.forward(q, k, v, first.masked, self.scale)
            else:
                out, lse = masked_forward(self.kernel, q, k, v, spans, self.scale)
            outs, lses = (_split(t, q_sizes, one_block_q) for t in (out, lse))
            for (z, part), o, m in zip(q_parts.items(), outs, lses, strict=True):
                self._accumulator(Kind.O, z, heads).add(part, [o, m], computed=one_block_q)
            return
        outs = [
            self._out(z, part, heads, t[1], t[3])
            for (z, part), t in zip(q_parts.items(), q_in, strict=True)
        ]
        q, dout, lse = (_cat([t[i] for t in q_in]) for i in (0, 1, 2))
        out = _cat(outs)
        if spans is None:
            dq, dk, dv = self.kernel.backward(dout, q, k, v, out, lse, first.masked, self.scale)
        else:
            dq, dk, dv = masked_backward(self.kernel, dout, q, k, v, out, lse, spans, self.scale)
        if self.expand:
            h_kv = group_heads(self.space.shape, heads)[1]
            dk, dv = (fold_kv_heads(g, h_kv) for g in (dk, dv))
        for (z, part), g in zip(q_parts.items(), _split(dq, q_sizes, one_block_q), strict=True):
            self._accumulator(Kind.DQ, z, heads).add(part, [g], computed=one_block_q)
        dks, dvs = (_split(t, kv_sizes, one_block_kv) for t in (dk, dv))
        for (y, part), gk, gv in zip(kv_parts.items(), dks, dvs, strict=True):
            self._accumulator(Kind.DKV, y, heads).add(part, [gk, gv], computed=one_block_kv)

    def _merge(self, run: list[Merge]) -> None:
        """Fold in one received partial, or the sum of a run of partial gradients of one piece
        (Note [Summed partials])."""
        p = run[0].payload
        got = [self.partials.pop((m.handle, m.peer, p.kind, p.owner, p.heads)) for m in run]
        part, bufs = got[0]
        if len(got) > 1:
            # one stack and one float32 sum per tensor (dk, dv) in place of a merge per sender
            bufs = [
                torch.stack(ts).sum(dim=0, dtype=torch.float32)
                for ts in zip(*(b for _, b in got), strict=True)
            ]
        self._accumulator(p.kind, p.owner, p.heads).add(part, bufs, computed=False)

    def _buffer_bytes(self, own: set[Key]) -> int:
        # runs after every instruction of a traced pass: plain loops over ``nbytes``
        kept = {id(t) for t in self.kept.values()}
        total = 0
        for t in self.kept.values():
            total += t.nbytes
        for k, (_, tensors) in self.inputs.items():
            if k not in own:
                for t in tensors:
                    if id(t) not in kept:
                        total += t.nbytes
        for _, received, _, allocated in self.pending.values():
            total += allocated
            for _, _, bufs in received:
                for t in bufs:
                    total += t.nbytes
        for acc in self.accumulators.values():
            for t in acc.tensors:
                total += t.nbytes
        for _, bufs in self.partials.values():
            for t in bufs:
                total += t.nbytes
        for tensors in self.expanded.values():
            for t in tensors:
                total += t.nbytes
        return total

    def _step(self, run: list) -> None:
        """One step of :func:`steps`: an instruction, or a run that one operation does."""
        ins = run[0]
        if isinstance(ins, Exchange):
            self._exchange(ins)
        elif isinstance(ins, Wait):
            self._wait(ins)
        elif isinstance(ins, Compute):
            self._compute(run)
        else:
            self._merge(run)

    def run(self) -> dict[Key, Accumulator]:
        """Run the program; return this rank's final accumulators."""
        own = set(self.inputs)
        # Note [Derived once]
        derived = pass_steps(
            self.prog, frozenset(own), self.backward, self.mask is None, self.expand
        )
        release, drops = derived.release, derived.drops
        events: list[tuple[str, str, float, float]] | None = None
        if self.trace is not None:
            events = []
        instrs = self.prog.instrs
        for i, end in derived.steps:
            ins = instrs[i]
            t0 = time.perf_counter() if events is not None else 0.0
            self._step(list(instrs[i:end]))
            if self.staged and not (self.runs_receives_first and run_goes_on(instrs, i)):
                self._post()
            if events is not None:
                channel = getattr(ins, "channel", "")
                if isinstance(ins, Wait):
                    channel = self.exchanges[ins.handle].channel
                events.append((type(ins).__name__, channel, t0, time.perf_counter()))
                peak = self._buffer_bytes(own)
                self.stats.peak_buffer_bytes = max(self.stats.peak_buffer_bytes, peak)
            for j in range(i, end):
                for key in release.get(j, ()):
                    self.inputs.pop(key, None)
                for owner in drops.get(j, ()):
                    self.expanded.pop(owner, None)
        assert not self.pending and not self.partials and not self.expanded and not self.staged
        assert not (self.backward and self.kept), "kept q pieces the backward never used"
        if self.trace is not None:
            self.trace.append(RunTrace(self.prog.cp_rank, self.backward, self.stats, events or []))
        return self.accumulators
