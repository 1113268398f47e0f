"""Compute model: the time of one attention block and of one partial-result merge.

Two sources:

* :class:`FlopsCompute`: FLOPs of the block divided by an achieved rate (peak TFLOPS x efficiency).
  A forward block of ``tq`` queries against ``tk`` keys costs ``4 * b * h * d * tq * tk`` FLOPs
  (``QK^T`` and ``PV``), half of that when causal-masked on local positions; a backward block
  costs ``bwd_ratio`` times its forward (flash-attention's backward runs five matmuls to the
  forward's two: 2.5).
* :class:`CalibratedCompute`: measured seconds of one full ``s_local x s_local`` block, forward and
  backward (e.g. from the attention benchmark), scaled by the block's area.

A merge (``Reduce``) reads the accumulator and the partial and writes the accumulator: three times
the payload's bytes at memory bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, head_fraction


def block_area(ins: Compute, shape: AttnShape) -> float:
    """Fraction of a full unmasked ``s_local x s_local`` block on all heads that ``ins``
    computes (a block of one head group of ``n`` is ``1/n`` of its area)."""
    area = ins.q_part.fraction * ins.kv_part.fraction * head_fraction(ins.heads)
    return area * 0.5 if ins.masked else area


def block_flops(ins: Compute, shape: AttnShape, backward: bool, bwd_ratio: float = 2.5) -> float:
    """FLOPs of one block (forward, or backward as ``bwd_ratio`` x forward)."""
    full = 4.0 * shape.b * shape.h * shape.d * shape.s_local * shape.s_local
    flops = full * block_area(ins, shape)
    return flops * bwd_ratio if backward else flops


@dataclass(frozen=True)
class FlopsCompute:
    """Block time from FLOPs and an achieved rate."""

    tflops: float
    """Peak TFLOPS of one GPU (dense, input dtype)."""
    efficiency: float = 0.5
    """Achieved fraction of ``tflops`` inside attention blocks."""
    bwd_ratio: float = 2.5
    """Backward FLOPs per forward FLOP of a block."""
    mem_bw: float = 2000.0
    """Memory bandwidth for merges, GB/s."""
    block_overhead: float = 0.0
    """Fixed seconds per block (kernel launch, tiny-block inefficiency)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tflops) and self.tflops > 0) or not 0 < self.efficiency <= 1:
            raise ValueError(
                f"tflops {self.tflops} must be > 0 and efficiency {self.efficiency} in (0, 1]; "
                "pass --tflops and --efficiency accordingly"
            )

    def block_time(self, ins: Compute, shape: AttnShape, backward: bool) -> float:
        rate = self.tflops * 1e12 * self.efficiency
        return block_flops(ins, shape, backward, self.bwd_ratio) / rate + self.block_overhead

    def reduce_time(self, nbytes: int) -> float:
        return 3.0 * nbytes / (self.mem_bw * 1e9)


@dataclass(frozen=True)
class CalibratedCompute:
    """Block time from a measured full-block time (seconds), scaled by block area."""

    fwd_block: float
    """Measured seconds of one forward ``s_local x s_local`` unmasked block."""
    bwd_block: float
    """Measured seconds of one backward ``s_local x s_local`` unmasked block."""
    mem_bw: float = 10.0
    """Memory bandwidth for merges, GB/s (a CPU's effective copy rate by default)."""
    block_overhead: float = 0.0
    """Fixed seconds per block."""

    def block_time(self, ins: Compute, shape: AttnShape, backward: bool) -> float:
        full = self.bwd_block if backward else self.fwd_block
        return full * block_area(ins, shape) + self.block_overhead

    def reduce_time(self, nbytes: int) -> float:
        return 3.0 * nbytes / (self.mem_bw * 1e9)


ComputeModel = FlopsCompute | CalibratedCompute
