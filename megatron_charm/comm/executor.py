"""Runs one rank's program on tensors with torch.distributed point-to-point ops.

The same code serves gloo (CPU) and NCCL (GPU): exchanges are ``batch_isend_irecv`` groups on the
channel's process group, and ``Work.wait()`` is the only synchronisation (on CUDA it makes the
current stream wait for the transfer; the host does not block). Nothing here calls
``torch.cuda.synchronize``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_charm.comm.buffers import Accumulator, Dims, part_of, payload_specs
from megatron_charm.comm.topology import CPTopology
from megatron_charm.kernels import BlockKernel
from megatron_charm.plan.types import Compute, Exchange, Kind, Part, Program, Reduce, Wait

Tensor = torch.Tensor


@dataclass
class RunStats:
    """What one pass moved and held; filled by the executor.

    ``peak_buffer_bytes`` is the largest total, after any instruction, of what the pass allocates
    beyond the caller's tensors: received inputs still to be used, receive buffers in flight,
    accumulators and received partials.
    """

    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak_buffer_bytes: int = 0


@dataclass
class RunTrace:
    """One pass as seen by the optional instrumentation (see :data:`RUN_LOG`).

    ``events`` holds ``(instruction kind, channel or "", start, end)`` with host
    ``time.perf_counter()`` seconds; on CUDA they are host enqueue times, not device times.
    """

    cp_rank: int
    backward: bool
    stats: RunStats
    events: list[tuple[str, str, float, float]]


#: Optional instrumentation for benchmarks. ``None`` (the default) costs one test per pass; a
#: list receives one :class:`RunTrace` per :meth:`ProgramRunner.run`.
RUN_LOG: list[RunTrace] | None = None


def release_points(program: Program, own: set[tuple[Kind, int]], backward: bool) -> dict[int, list]:
    """Instruction index -> received input keys whose last use is that instruction (pure).

    A key can be received again later (CHARM+ rounds fetch kv anew); each delivery starts a new
    lifetime that ends at its last use before the next delivery.
    """
    qkind = Kind.QB if backward else Kind.Q
    last: dict[tuple[Kind, int], int] = {}
    out: dict[int, list] = defaultdict(list)
    recv_keys: dict[int, list] = {}
    for i, ins in enumerate(program.instrs):
        if isinstance(ins, Exchange):
            recv_keys[ins.handle] = [
                (op.payload.kind, op.payload.owner)
                for op in ins.ops
                if not op.send and not op.payload.kind.is_partial
            ]
            used = [
                (op.payload.kind, op.payload.owner)
                for op in ins.ops
                if op.send and not op.payload.kind.is_partial
            ]
        elif isinstance(ins, Wait):
            for key in recv_keys.get(ins.handle, []):
                if key in last:
                    out[last.pop(key)].append(key)
            used = recv_keys.get(ins.handle, [])
        elif isinstance(ins, Compute):
            used = [(qkind, ins.q_owner), (Kind.KV, ins.kv_owner)]
        else:
            used = []
        for key in used:
            if key not in own:
                last[key] = i
    for key, i in last.items():
        out[i].append(key)
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class DistributedError(RuntimeError):
    """A peer failed or timed out during a CP attention exchange."""


class ProgramRunner:
    """Interprets a :class:`Program` for one pass.

    ``held`` maps ``(kind, owner)`` to ``(part, tensors)`` for inputs this rank holds (its own q/kv,
    or its backward bundle); received payloads are added as their exchanges complete.
    """

    def __init__(
        self,
        topo: CPTopology,
        program: Program,
        raw: dict[tuple[int, int, int], bool],
        dims: Dims,
        kernel: BlockKernel,
        scale: float,
        backward: bool,
        held: dict[tuple[Kind, int], tuple[Part, list[Tensor]]],
    ) -> None:
        self.topo = topo
        self.prog = program
        self.raw = raw
        self.dims = dims
        self.kernel = kernel
        self.scale = scale
        self.backward = backward
        self.held = held
        self.accs: dict[tuple[Kind, int], Accumulator] = {}
        self.pending: dict[int, tuple[list, list]] = {}
        self.partials: dict[tuple[int, Kind, int], tuple[Part, list[Tensor], bool]] = {}
        self.stats = RunStats()

    def _get(self, kind: Kind, owner: int, part: Part) -> list[Tensor]:
        held = self.held.get((kind, owner))
        if held is None or not held[0].contains(part):
            raise AssertionError(
                f"cp_rank {self.prog.cp_rank} lacks {kind.value}{owner}.{part.value}"
            )
        return [part_of(t, held[0], part, self.dims.s) for t in held[1]]

    def _acc(self, kind: Kind, owner: int) -> Accumulator:
        acc = self.accs.get((kind, owner))
        if acc is None:
            acc = self.accs[(kind, owner)] = Accumulator(kind, self.dims)
        return acc

    def _global(self, cp_rank: int) -> int:
        return self.topo.global_ranks[cp_rank]

    def _exchange(self, ex: Exchange) -> None:
        group = self.topo.channel(ex.channel)
        ops, recvs = [], []
        me = self.prog.cp_rank
        for k, op in enumerate(ex.ops):
            p = op.payload
            raw = self.raw.get((me, ex.handle, k), True)
            peer = self._global(op.peer)
            if op.send:
                if p.kind.is_partial:
                    acc = self.accs.pop((p.kind, p.owner))
                    assert acc.part == p.part
                    tensors = acc.wire(raw)
                else:
                    tensors = [t.contiguous() for t in self._get(p.kind, p.owner, p.part)]
                for t in tensors:
                    ops.append(dist.P2POp(dist.isend, t, peer, group))
                    self.stats.bytes_sent[ex.channel] += t.numel() * t.element_size()
            else:
                bufs = [
                    torch.empty(shape, dtype=dtype, device=self.dims.device)
                    for shape, dtype in payload_specs(p, self.dims, raw)
                ]
                for t in bufs:
                    ops.append(dist.P2POp(dist.irecv, t, peer, group))
                recvs.append((p, bufs, raw))
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            raise self._failure(ex, exc) from exc
        self.pending[ex.handle] = (works, recvs)

    def _failure(self, ex: Exchange, exc: BaseException) -> DistributedError:
        peers = sorted({op.peer for op in ex.ops})
        return DistributedError(
            f"CP attention exchange on channel {ex.channel} between cp_rank {self.prog.cp_rank} "
            f"and cp_rank(s) {peers} failed: {exc}. A peer rank died, timed out (timeout "
            f"{self.topo.timeout}), or runs a different method/shape"
        )

    def _wait(self, w: Wait, ex_by_handle: dict[int, Exchange]) -> None:
        works, recvs = self.pending.pop(w.handle)
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise self._failure(ex_by_handle[w.handle], exc) from exc
        for p, bufs, raw in recvs:
            if p.kind.is_partial:
                self.partials[(w.handle, p.kind, p.owner)] = (p.part, bufs, raw)
            else:
                self.held[(p.kind, p.owner)] = (p.part, bufs)

    def _compute(self, c: Compute) -> None:
        qkind = Kind.QB if self.backward else Kind.Q
        q_in = self._get(qkind, c.q_owner, c.q_part)
        k, v = self._get(Kind.KV, c.kv_owner, c.kv_part)
        if not self.backward:
            out, lse = self.kernel.forward(q_in[0], k, v, c.masked, self.scale)
            self._acc(Kind.O, c.q_owner).add(c.q_part, [out, lse], from_compute=True)
            return
        q, out, dout, lse = q_in
        dq, dk, dv = self.kernel.backward(dout, q, k, v, out, lse, c.masked, self.scale)
        self._acc(Kind.DQ, c.q_owner).add(c.q_part, [dq], from_compute=True)
        self._acc(Kind.DKV, c.kv_owner).add(c.kv_part, [dk, dv], from_compute=True)

    def _reduce(self, r: Reduce) -> None:
        part, bufs, _ = self.partials.pop((r.handle, r.payload.kind, r.payload.owner))
        self._acc(r.payload.kind, r.payload.owner).add(part, bufs, from_compute=False)

    def _held_bytes(self, own: set) -> int:
        total = sum(_nbytes(t) for k, (_, t) in self.held.items() if k not in own)
        total += sum(_nbytes(b) for _, recvs in self.pending.values() for _, b, _ in recvs)
        total += sum(_nbytes(a.tensors) for a in self.accs.values())
        total += sum(_nbytes(b) for _, b, _ in self.partials.values())
        return total

    def run(self) -> dict[tuple[Kind, int], Accumulator]:
        ex_by_handle = {}
        own = set(self.held)
        release = release_points(self.prog, own, self.backward)
        log = RUN_LOG
        events: list | None = None if log is None else []
        for i, ins in enumerate(self.prog.instrs):
            if events is not None:
                t0 = time.perf_counter()
            if isinstance(ins, Exchange):
                ex_by_handle[ins.handle] = ins
                self._exchange(ins)
            elif isinstance(ins, Wait):
                self._wait(ins, ex_by_handle)
            elif isinstance(ins, Compute):
                self._compute(ins)
            elif isinstance(ins, Reduce):
                self._reduce(ins)
            if events is not None:
                channel = ins.channel if isinstance(ins, Exchange) else ""
                if isinstance(ins, Wait):
                    channel = ex_by_handle[ins.handle].channel
                events.append((type(ins).__name__, channel, t0, time.perf_counter()))
            peak = self._held_bytes(own)
            self.stats.peak_buffer_bytes = max(self.stats.peak_buffer_bytes, peak)
            for key in release.get(i, ()):
                self.held.pop(key, None)
        assert not self.pending and not self.partials
        if log is not None:
            log.append(RunTrace(self.prog.cp_rank, self.backward, self.stats, events))
        return self.accs
