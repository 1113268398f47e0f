"""Ring attention run sequentially, for the paper's CCR (Eq. 7) and the pure compute time.

The paper accumulates ring attention's computation and communication times "under sequential
execution". Here the ``ring`` plan's programs are rewritten so that every exchange is waited for
right after it is posted: nothing overlaps, and the executor's trace separates the two. Compute is
the time in ``Compute`` and ``Reduce`` instructions (block kernels and merges).

Communication is timed in a second sequential run whose block kernels are replaced by a kernel that
only allocates zero results (:data:`NULL_KERNEL`): the time in ``Exchange`` and ``Wait`` is then the
transfers alone. In the first run, a wait would also include a slower peer's compute, which on a
machine whose ranks share cores is not communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_charm.comm import executor
from megatron_charm.comm.buffers import Dims
from megatron_charm.comm.executor import ProgramRunner
from megatron_charm.function import validated_plan
from megatron_charm.kernels import BlockKernel, select_kernel
from megatron_charm.plan import Layout
from megatron_charm.plan.types import Exchange, Kind, Part, Program, Wait

Tensor = torch.Tensor


def _null_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    return torch.zeros_like(q), torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)


def _null_bwd(dout, q, k, v, out, lse, causal, scale):
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


#: Block kernel that computes nothing (zeros of the right shapes): isolates communication time.
NULL_KERNEL = BlockKernel("null", _null_fwd, _null_bwd)


def sequential(program: Program) -> Program:
    """The same instructions with each ``Wait`` moved right after its ``Exchange`` (pure)."""
    waits = {ins.handle for ins in program.instrs if isinstance(ins, Wait)}
    out: list = []
    for ins in program.instrs:
        if isinstance(ins, Wait):
            continue
        out.append(ins)
        if isinstance(ins, Exchange) and ins.handle in waits:
            out.append(Wait(ins.handle))
    return Program(program.cp_rank, out)


@dataclass
class SeqTimes:
    """Seconds one rank spent computing and communicating in one sequential pass."""

    compute: float
    comm: float


def _split(trace: executor.RunTrace) -> SeqTimes:
    comp = sum(e - s for kind, _, s, e in trace.events if kind in ("Compute", "Reduce"))
    comm = sum(e - s for kind, _, s, e in trace.events if kind in ("Exchange", "Wait"))
    return SeqTimes(comp, comm)


def run_sequential_ring(
    topo,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    causal: bool,
    scale: float,
    kernel: str | BlockKernel | None = None,
) -> tuple[SeqTimes, SeqTimes]:
    """One forward and one backward pass of sequential ring attention on this rank.

    Args:
        q, dout: ``[s_local, b, h, d]``; k, v: ``[s_local, b, h_kv, d]`` (``sbhd``, zigzag).
        kernel: a kernel name, or a :class:`BlockKernel` such as :data:`NULL_KERNEL`.

    Returns:
        ``(forward, backward)`` times of this rank.
    """
    plan, fwd_raw, bwd_raw = validated_plan("ring", Layout(1, topo.cp_size), causal)
    x = topo.cp_rank
    dims = Dims(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype, q.device)
    blk = kernel if isinstance(kernel, BlockKernel) else select_kernel(q.device, q.dtype, kernel)
    saved, executor.RUN_LOG = executor.RUN_LOG, []
    try:
        held = {(Kind.Q, x): (Part.FULL, [q]), (Kind.KV, x): (Part.FULL, [k, v])}
        fwd = ProgramRunner(
            topo, sequential(plan.forward[x]), fwd_raw, dims, blk, scale, False, held
        )
        acc = fwd.run()[(Kind.O, x)]
        out32, lse = acc.tensors if not acc.raw else (acc.tensors[0].float(), acc.tensors[1])
        out = out32.to(q.dtype)
        held = {
            (Kind.QB, x): (Part.FULL, [q, out, dout, lse.contiguous()]),
            (Kind.KV, x): (Part.FULL, [k, v]),
        }
        bwd = ProgramRunner(
            topo, sequential(plan.backward[x]), bwd_raw, dims, blk, scale, True, held
        )
        bwd.run()
        if q.is_cuda:
            torch.cuda.synchronize()
        traces = executor.RUN_LOG
    finally:
        executor.RUN_LOG = saved
    return _split(traces[0]), _split(traces[1])
