"""Ring attention run sequentially, for the paper's CCR (Eq. 7) and the pure compute time.

The paper accumulates ring attention's computation and communication times "under sequential
execution". Here the ``ring`` plan's programs are rewritten so that every exchange is waited for
right after it is posted: nothing overlaps, and the executor's trace separates the two. Compute is
the time in ``Compute`` and ``Merge`` instructions (block kernels and merges).

Communication is timed in a second sequential run whose block kernels are replaced by a kernel that
only allocates zero results (:data:`NULL_KERNEL`): the time in ``Exchange`` and ``Wait`` is then the
transfers alone. In the first run, a wait would also include a slower peer's compute, which on a
machine whose ranks share cores is not communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_charm.comm.executor import RunTrace
from megatron_charm.comm.topology import CPTopology
from megatron_charm.function import backward_pass, forward_pass, validated_plan
from megatron_charm.kernels import BlockKernel, select_kernel
from megatron_charm.plan import PlanOptions

Tensor = torch.Tensor


def _null_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    return torch.zeros_like(q), torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)


def _null_bwd(dout, q, k, v, out, lse, causal, scale):
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


#: Block kernel that computes nothing (zeros of the right shapes): isolates communication time.
NULL_KERNEL = BlockKernel("null", _null_fwd, _null_bwd)


@dataclass
class SeqTimes:
    """Seconds one rank spent computing and communicating in one sequential pass."""

    compute: float
    comm: float


def _split(trace: RunTrace) -> SeqTimes:
    comp = sum(e - s for kind, _, s, e in trace.events if kind in ("Compute", "Merge"))
    comm = sum(e - s for kind, _, s, e in trace.events if kind in ("Exchange", "Wait"))
    return SeqTimes(comp, comm)


def run_sequential_ring(
    topo: CPTopology,
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
    plan = validated_plan(PlanOptions(method="ring"), topo.layout, causal)
    x = topo.cp_rank
    blk = kernel if isinstance(kernel, BlockKernel) else select_kernel(q.device, q.dtype, kernel)
    traces: list[RunTrace] = []
    out, lse, _ = forward_pass(topo, plan.forward[x].without_overlap(), q, k, v, blk, scale, traces)
    backward_pass(
        topo, plan.backward[x].without_overlap(), q, k, v, out, lse, dout, blk, scale, traces
    )
    if q.is_cuda:
        torch.cuda.synchronize()
    return _split(traces[0]), _split(traces[1])
