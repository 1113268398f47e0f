"""Compute model: the time of one attention block and of one partial-result merge.

Two sources:

* :class:`FlopsCompute`: FLOPs of the block divided by an achieved rate (peak TFLOPS x efficiency).
  A forward block of ``tq`` queries against ``tk`` keys costs ``4 * b * h * d * tq * tk`` FLOPs
  (``QK^T`` and ``PV``), half of that when causal-masked on local positions; a backward block
  costs ``bwd_ratio`` times its forward (flash-attention's backward runs five matmuls to the
  forward's two: 2.5). With the GPU's SM count (``sms``, every preset) the FLOPs run in tiles
  and waves (Note [Tiles and waves]), so small blocks cost more per FLOP.
* :class:`CalibratedCompute`: measured seconds of one full ``s_local x s_local`` block, forward and
  backward (e.g. from the attention benchmark), scaled by the block's area.
* :class:`FittedCompute`: a fixed cost per block, a cost per element of the block's rows and
  FLOPs at a rate, forward and backward each fitted by least squares to kernel timings over
  block shapes (``megatron-charm-sim calibrate``; Note [Block shapes]), so small blocks cost
  more per FLOP than large ones; times a measured slowdown while communication runs next to
  the kernel.

A merge (``Reduce``) reads the accumulator and the partial and writes the accumulator: three times
the payload's bytes at memory bandwidth.

On a GPU the host enqueues every device operation ahead of the device (:class:`Enqueue`, Note
[Enqueue ahead] in :mod:`megatron_charm.sim.engine`); on a CPU host the same work is charged as
host work (Note [Host work of a call] in :mod:`megatron_charm.sim.profile`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_charm.plan.coalesce import run_pieces
from megatron_charm.plan.payloads import AttnShape, group_heads
from megatron_charm.plan.types import Compute, Exchange, Heads, head_fraction


def block_area(ins: Compute, shape: AttnShape) -> float:
    """Fraction of a full unmasked ``s_local x s_local`` block on all heads that ``ins``
    computes (a block of one head group of ``n`` is ``1/n`` of its area)."""
    area = ins.q_part.fraction * ins.kv_part.fraction * head_fraction(ins.heads)
    return area * 0.5 if ins.masked else area


def block_elements(ins: Compute, shape: AttnShape) -> float:
    """Elements of the rows one block reads: ``b * d * (h * tq + h_kv * tk)`` for ``tq`` query
    and ``tk`` key tokens of the block's head group (Note [Block shapes])."""
    h, h_kv = group_heads(shape, ins.heads)
    tq, tk = shape.s_local * ins.q_part.fraction, shape.s_local * ins.kv_part.fraction
    return float(shape.b * shape.d * (h * tq + h_kv * tk))


#: Backward FLOPs per forward FLOP of a block: flash-attention's backward runs five matmuls to
#: the forward's two.
BWD_FLOPS_RATIO = 2.5


def block_flops(
    ins: Compute, shape: AttnShape, backward: bool, bwd_ratio: float = BWD_FLOPS_RATIO
) -> float:
    """FLOPs of one block (forward, or backward as ``bwd_ratio`` x forward)."""
    full = 4.0 * shape.b * shape.h * shape.d * shape.s_local * shape.s_local
    flops = full * block_area(ins, shape)
    return flops * bwd_ratio if backward else flops


# Note [Tiles and waves]
# ~~~~~~~~~~~~~~~~~~~~~~
# A GPU attention kernel (FlashAttention-2, which the paper's baselines and our CUDA path run)
# splits a block into tiles, one thread block (CTA) each, and runs them in waves over the SMs:
#
#     forward, tq x tk:   CTAs = ceil(tq / 128) * b * h       each: 128 query rows x all tk keys
#     backward, tq x tk:  CTAs = ceil(tk / T) * b * h         each: T key rows x all tq queries
#                         T = 128 for head dims <= 128, 64 above (FA2's backward kernel traits)
#
#     time = ceil(CTAs / sms) * (FLOPs of one full tile) / (rate / sms)
#
# One CTA runs per SM at a time (FA2's 8-warp kernels use the whole register file; its 4-warp
# forward kernel for head dim 128 can hold two, which this does not count). A partial last tile
# costs a full one, and a last wave with few CTAs costs a full one: a block of 210 tokens, 12
# heads and batch 1 runs 24 CTAs on an H100's 132 SMs, one wave of one tile each, 6.7 times its
# FLOPs' time at the rate. Large blocks come within a few percent of FLOPs / rate (Table 5's
# 2 x 8 blocks: 1.10 times). ``efficiency`` is then the rate of a full wave. The tile sizes are
# FlashAttention-2's launch templates (``flash_fwd_launch_template.h``: ``kBlockM = 128`` for
# every forward head dim without dropout; ``flash_bwd_launch_template.h``: ``kBlockN = 128`` up to
# head dim 128, 64 for 160-256), the SM counts the GPUs' (Hardware.sms).
#
# NCCL's kernels take SMs too: a point-to-point exchange runs its two channels per peer as two
# CTAs for as long as it is in flight (NCCL_P2P_CTAS), so a block that starts while its rank has
# exchanges in flight gets the SMs they leave: ``sms / (sms - held)`` as long for a large block,
# 1.5% per single-peer exchange on an H100. An exchange with several peers (an all-to-all step:
# TASP's, all_gather's) runs its peers' channels side by side, as many as NCCL's pool of
# point-to-point channels holds (NCCL_P2P_CHANNELS): a send to rank + j and a receive from
# rank - j share one round of channels, so ``held = min(pool, 2 x rounds)``, rounds the larger
# of the exchange's distinct destinations and sources (FlopsCompute.held_by). This is the whole
# of the SM sharing the model knows; the compute stream's own interference with copies (memory
# bandwidth) is not in it.

#: FlashAttention-2's query rows per forward CTA, and key rows per backward CTA by head dim.
FA2_FWD_TILE = 128
#: SMs that one in-flight NCCL point-to-point exchange holds per round of peers: NCCL runs a
#: channel as one CTA and gives point-to-point two channels per peer (its init log of a 4-rank
#: job on two H20 nodes: "8 p2p channels, 2 p2p channels per peer", NVIDIA/nccl issue 1189).
NCCL_P2P_CTAS = 2
#: NCCL's pool of point-to-point channels, the most CTAs one exchange runs however many peers
#: it has. NCCL sizes it from its collective channels (``ncclTopoComputeP2pChannels``: the next
#: power of two of their count); init logs report 8 on that H20 job (NVIDIA/nccl issue
#: 1189), 16 on a 32-rank multi-node one and 32 on an 8-rank two-node one: 16 here.
NCCL_P2P_CHANNELS = 16


def fa2_bwd_tile(head_dim: int) -> int:
    """Key rows per backward CTA of FlashAttention-2 for ``head_dim`` (Note [Tiles and
    waves])."""
    return 128 if head_dim <= 128 else 64


def tiled_flops(ins: Compute, shape: AttnShape, backward: bool, sms: int) -> float:
    """Forward FLOPs that one block takes as tiles in waves over ``sms`` SMs (Note [Tiles and
    waves]): whole waves of whole tiles, half when causal-masked (the backward's ``bwd_ratio``
    is applied by the caller)."""
    tq, tk = shape.s_local * ins.q_part.fraction, shape.s_local * ins.kv_part.fraction
    flops = _waves_flops(tq, tk, ins.heads, shape, backward, sms)
    return flops * 0.5 if ins.masked else flops


def _waves_flops(
    tq: float, tk: float, heads: Heads | None, shape: AttnShape, backward: bool, sms: int
) -> float:
    """Forward FLOPs of one unmasked kernel call of ``tq`` queries against ``tk`` keys on the
    head group ``heads``, as whole tiles in whole waves (Note [Tiles and waves])."""
    h = max(1, round(shape.h * head_fraction(heads)))
    if backward:
        tile, rows, cols = fa2_bwd_tile(shape.d), tk, tq
    else:
        tile, rows, cols = FA2_FWD_TILE, tq, tk
    ctas = math.ceil(rows / tile - 1e-9) * shape.b * h
    waves = math.ceil(ctas / sms - 1e-9)
    return waves * sms * 4.0 * tile * cols * shape.d


def run_tiled_flops(run: Sequence[Compute], shape: AttnShape, backward: bool, sms: int) -> float:
    """Forward FLOPs of a coalesced run of unmasked blocks as the one kernel call the executor
    makes of it (Note [Coalesced blocks] in :mod:`megatron_charm.plan.coalesce`): its query
    pieces concatenated against its kv pieces, whole tiles in whole waves over ``sms`` SMs
    (Note [Run of blocks, one call])."""
    q_parts, kv_parts = run_pieces(run)
    tq = shape.s_local * sum(p.fraction for p in q_parts)
    tk = shape.s_local * sum(p.fraction for p in kv_parts)
    return _waves_flops(tq, tk, run[0].heads, shape, backward, sms)


def run_excess_flops(run: Sequence[Compute], shape: AttnShape, backward: bool, sms: int) -> float:
    """Forward FLOPs that the blocks of ``run`` tiled one by one take beyond the run's one call
    (:func:`run_tiled_flops`); ``>= 0``."""
    apart = sum(tiled_flops(c, shape, backward, sms) for c in run)
    return apart - run_tiled_flops(run, shape, backward, sms)


# Note [Run of blocks, one call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A coalesced run is one kernel call on the concatenated pieces, so its tiles and waves are the
# call's, not the sum of its blocks' (Note [Tiles and waves]). Priced block by block, a run of
# thin blocks paid a partial wave per block: tasp's backward step on 2 x 8 at 131,040 tokens
# (16 heads of 128) runs q against 15 kv chunks of 546 tokens, each 5 key tiles x 16 heads =
# 80 CTAs on 132 SMs, a wave of which did a full wave's FLOPs: 1.9 times the chunk's own; as
# one call the 15 chunks are 64 key tiles, 1024 CTAs in 8 waves, 1.03 times. The forward tiles
# queries, which a run's blocks share, so it moves little there. A model prices a run's FLOPs
# term as the call's (``run_saving``), its fixed cost once (``call_overhead``), and the rest
# (per-element work, masks) block by block as before.


def kernel_flops(
    ins: Compute, shape: AttnShape, backward: bool, sms: int, bwd_ratio: float = BWD_FLOPS_RATIO
) -> float:
    """FLOPs that a block's kernel runs: its own (:func:`block_flops`) or, with a GPU's ``sms``,
    whole tiles in whole waves (:func:`tiled_flops`); a backward block at ``bwd_ratio`` times."""
    if not sms:
        return block_flops(ins, shape, backward, bwd_ratio)
    return tiled_flops(ins, shape, backward, sms) * (bwd_ratio if backward else 1.0)


@dataclass(frozen=True)
class Enqueue:
    """Host seconds to enqueue one pass's device operations on a GPU (Note [Enqueue ahead] in
    :mod:`megatron_charm.sim.engine`). The host runs ahead of the device and costs nothing
    while the device is busier; on small problems the device waits for it."""

    call: float = 0.0
    """Per pass, before its first operation (the autograd function, plan lookup, buffers)."""
    exchange: float = 0.0
    """Per posted exchange (the backend's P2P calls)."""
    kernel: float = 0.0
    """Per kernel call (a coalesced run of blocks is one call)."""
    merge: float = 0.0
    """Per merge of partial results (a few elementwise kernels)."""

    def __post_init__(self) -> None:
        values = (self.call, self.exchange, self.kernel, self.merge)
        if not all(math.isfinite(x) and x >= 0 for x in values):
            raise ValueError(
                f"enqueue seconds {values} (call, exchange, kernel, merge) must be finite and "
                ">= 0; pass non-negative --enqueue-us or fix the profile"
            )

    @property
    def any(self) -> bool:
        return max(self.call, self.exchange, self.kernel, self.merge) > 0

    @classmethod
    def per_operation(cls, seconds: float) -> Enqueue:
        """The same ``seconds`` for every kind of operation and for the pass's call."""
        return cls(call=seconds, exchange=seconds, kernel=seconds, merge=seconds)

    def times(self, factor: float) -> Enqueue:
        """Every cost times ``factor``."""
        return Enqueue(*(factor * getattr(self, f.name) for f in dataclasses.fields(self)))


def _load_enqueue(model: object) -> None:
    """A profile read from JSON holds the enqueue costs as a dict."""
    got = getattr(model, "enqueue", None)
    if isinstance(got, dict):
        object.__setattr__(model, "enqueue", Enqueue(**got))


class _MergeCost:
    """What every compute model shares: the time of a merge from its ``mem_bw`` (GB/s), and no
    slowdown under communication unless the model measured one."""

    mem_bw: float

    def reduce_time(self, nbytes: int) -> float:
        return 3.0 * nbytes / (self.mem_bw * 1e9)

    def slowdown(self, backward: bool, held: int = 1) -> float:
        """Block time while the rank's in-flight exchanges hold ``held`` (>= 1; the sum of
        :meth:`held_by` over them) over its time alone."""
        return 1.0

    def held_by(self, ex: Exchange) -> int:
        """What one in-flight exchange takes from the rank's blocks, in :meth:`slowdown`'s
        units: one exchange."""
        return 1

    def call_overhead(self, backward: bool) -> float:
        """The fixed seconds of one kernel call inside :meth:`block_time`, which a run of
        blocks that the executor does as one call pays once (Note [Coalesced blocks])."""
        return 0.0

    def run_saving(self, run: Sequence[Compute], shape: AttnShape, backward: bool) -> float:
        """Seconds that the coalesced ``run`` takes less as one kernel call than its blocks'
        :meth:`block_time` add up to, beyond :meth:`call_overhead` (Note [Run of blocks, one
        call]): none unless the model counts tiles and waves."""
        return 0.0

    def host_work(self) -> tuple[float, float]:
        """Host seconds ``(per pass, per posted exchange)`` outside kernels and transfers (Note
        [Host work of a call] in :mod:`megatron_charm.sim.profile`); none unless measured."""
        return 0.0, 0.0

    def host_per_byte(self) -> float:
        """Host seconds per byte a rank sends, charged on its stream with the exchange's
        posting (Note [Host work of a call]); none unless measured."""
        return 0.0

    def host_call_time(self, shape: AttnShape, backward: bool) -> float:
        """Host seconds of one pass of ``shape`` on the rank's thread outside its instructions:
        the per-pass part of :meth:`host_work` plus any part that grows with the rank's problem
        (Note [Host work of a call])."""
        return self.host_work()[0]

    def host_call_split(self, shape: AttnShape, backward: bool) -> tuple[float, float]:
        """:meth:`host_call_time` as ``(before the first instruction, with the pass's blocks)``
        (Note [Where a call's host work runs] in :mod:`megatron_charm.sim.profile`): all before
        unless measured."""
        return self.host_call_time(shape, backward), 0.0

    def transport_work(self) -> tuple[float, float]:
        """Seconds ``(per exchange, per byte sent)`` of the transport's own threads, which run
        on a shared host's cores while the exchange is in flight (Note [Host work of a call]);
        none unless measured."""
        return 0.0, 0.0

    def host_slots(self) -> float:
        """How many ranks can compute at full speed at once when every rank of the group shares
        one host's cores (Note [Ranks sharing a host]); 0: each rank has its own device."""
        return 0.0

    def enqueue_cost(self) -> Enqueue:
        """Host seconds that gate a GPU's device operations (Note [Enqueue ahead]); none unless
        given or measured."""
        return Enqueue()


@dataclass(frozen=True)
class FlopsCompute(_MergeCost):
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
    enqueue: Enqueue | None = None
    """Host enqueue seconds per device operation (Note [Enqueue ahead]); ``None``: none."""
    sms: int = 0
    """Streaming multiprocessors of the GPU: blocks run as tiles in waves over them (Note
    [Tiles and waves]); 0: FLOPs at the rate, however small the block."""

    def __post_init__(self) -> None:
        _load_enqueue(self)
        if not (math.isfinite(self.tflops) and self.tflops > 0) or not 0 < self.efficiency <= 1:
            raise ValueError(
                f"tflops {self.tflops} must be > 0 and efficiency {self.efficiency} in (0, 1]; "
                "pass --tflops and --efficiency accordingly"
            )
        if not isinstance(self.sms, int) or self.sms < 0:
            raise ValueError(f"sms {self.sms!r} must be a non-negative integer (0: no tiles)")

    def call_overhead(self, backward: bool) -> float:
        return self.block_overhead

    def enqueue_cost(self) -> Enqueue:
        return self.enqueue or Enqueue()

    def slowdown(self, backward: bool, held: int = 1) -> float:
        """The SMs that in-flight exchanges' NCCL kernels hold (``held`` CTAs) are not the
        block's (Note [Tiles and waves]): ``sms / (sms - held)``, at most twice as long; 1
        without an SM count."""
        if not self.sms:
            return 1.0
        free = max(self.sms - held, self.sms // 2)
        return self.sms / free

    def held_by(self, ex: Exchange) -> int:
        """The CTAs that ``ex``'s NCCL kernel runs while in flight (Note [Tiles and waves]): two
        per round of peers, at most NCCL's pool; one exchange without an SM count."""
        if not self.sms:
            return 1
        sends = len({op.peer for op in ex.ops if op.send})
        recvs = len({op.peer for op in ex.ops if not op.send})
        return min(NCCL_P2P_CHANNELS, NCCL_P2P_CTAS * max(sends, recvs, 1))

    def block_time(self, ins: Compute, shape: AttnShape, backward: bool) -> float:
        rate = self.tflops * 1e12 * self.efficiency
        flops = kernel_flops(ins, shape, backward, self.sms, self.bwd_ratio)
        return flops / rate + self.block_overhead

    def run_saving(self, run: Sequence[Compute], shape: AttnShape, backward: bool) -> float:
        if not self.sms:
            return 0.0
        saved = run_excess_flops(run, shape, backward, self.sms)
        saved *= self.bwd_ratio if backward else 1.0
        return saved / (self.tflops * 1e12 * self.efficiency)


@dataclass(frozen=True)
class CalibratedCompute(_MergeCost):
    """Block time from a measured full-block time (seconds), scaled by block area."""

    fwd_block: float
    """Measured seconds of one forward ``s_local x s_local`` unmasked block."""
    bwd_block: float
    """Measured seconds of one backward ``s_local x s_local`` unmasked block."""
    mem_bw: float = 10.0
    """Memory bandwidth for merges, GB/s (a CPU's effective copy rate by default)."""
    block_overhead: float = 0.0
    """Fixed seconds per block."""

    def call_overhead(self, backward: bool) -> float:
        return self.block_overhead

    def block_time(self, ins: Compute, shape: AttnShape, backward: bool) -> float:
        full = self.bwd_block if backward else self.fwd_block
        return full * block_area(ins, shape) + self.block_overhead


@dataclass(frozen=True)
class FittedCompute(_MergeCost):
    """Block time ``overhead + elements * per_element + flops / rate``, fitted separately for
    forward and backward (Note [Block shapes])."""

    fwd_flops_per_s: float
    """Achieved forward FLOP/s of the block kernel on large blocks."""
    bwd_flops_per_s: float
    """Achieved backward FLOP/s, counting a backward block as 2.5 x its forward FLOPs."""
    fwd_overhead: float = 0.0
    """Fixed seconds per forward block (launch, small-block inefficiency)."""
    bwd_overhead: float = 0.0
    """Fixed seconds per backward block."""
    mem_bw: float = 10.0
    """Memory bandwidth of a merge, GB/s."""
    fwd_per_element: float = 0.0
    """Forward seconds per element of the block's rows (:func:`block_elements`): the work that
    grows with the rows, not with their products (Note [Block shapes]). 0 in profiles fitted
    before it was measured."""
    bwd_per_element: float = 0.0
    """The same for backward blocks."""
    sms: int = 0
    """A GPU's SMs: the FLOPs term counts whole tiles in whole waves over them (Note [Tiles and
    waves]), as fitted; 0 (CPU profiles, and GPU profiles calibrated before 2026-12-04): the
    block's own FLOPs."""
    fwd_slowdown: float = 1.0
    """Forward block time under concurrent communication over its time alone (>= 1): the CPU
    cores or GPU SMs that transfers take. The engine applies it to a block that starts while
    its rank has an exchange in flight (:meth:`slowdown`)."""
    bwd_slowdown: float = 1.0
    """The same for backward blocks."""
    fwd_in_pass: float = 1.0
    """Forward blocks' CPU seconds inside passes of the real attention over the seconds alone
    that the fit above gives the same blocks (Note [Blocks in a pass] in
    :mod:`megatron_charm.sim.in_pass`); every block time and per-call overhead is scaled by it.
    1 where not measured (GPUs; CPU profiles fitted before 2026-12-06)."""
    bwd_in_pass: float = 1.0
    """The same for backward blocks."""
    shared_slots: float = 0.0
    """Ranks that the shared host runs at full speed at once (its cores over each rank's
    threads) when every rank of the group runs on one host, as on the CPU testbed: block times
    are then one rank's alone, and ranks computing together share the host (Note [Ranks
    sharing a host]). 0: each rank computes on its own device (GPUs)."""

    host_call_s: float = 0.0
    """Host seconds of one pass before its first instruction (Note [Host work of a call] in
    :mod:`megatron_charm.sim.profile`), one rank's alone."""
    host_post_s: float = 0.0
    """Host seconds of posting one exchange, one rank's alone."""
    host_byte_s: float = 0.0
    """Host seconds per byte an exchange sends, on the rank's own thread (buffers packed and
    unpacked), one rank's alone. 0 in profiles fitted before it was measured."""
    transport_post_s: float = 0.0
    """Seconds of the transport's threads per exchange (gloo's copies and TCP work at both
    ends), which take a shared host's cores while the exchange is in flight."""
    transport_byte_s: float = 0.0
    """The same per byte sent."""
    transport_in_pass: float = 1.0
    """The transport's CPU seconds inside passes of the real attention over what the two
    constants above charge the same passes (Note [Transport in a pass] in
    :mod:`megatron_charm.sim.in_pass`); :meth:`transport_work` is scaled by it. 1 where not
    measured (GPUs; CPU profiles calibrated before 2026-12-06 18:30 UTC)."""
    host_element_fwd_s: float = 0.0
    """Host seconds per element of the rank's queries (``b x s_local x h x d``) of a forward
    pass, on the rank's own thread at the pass's start (its buffers, casts and merges). 0 in
    profiles fitted before it was measured."""
    host_element_bwd_s: float = 0.0
    """The same for a backward pass."""
    host_first_fwd: float = 1.0
    """Share of a forward pass's call work (``host_call_s`` and the per-element part) that runs
    before its first instruction; the rest runs with the pass's blocks (Note [Where a call's
    host work runs] in :mod:`megatron_charm.sim.profile`). 1 in profiles fitted before
    2026-12-06 16:30 UTC."""
    host_first_bwd: float = 1.0
    """The same for a backward pass."""
    masked_cost: tuple[tuple[int, float, float], ...] = ()
    """``(tokens, forward, backward)`` per measured size: the time of a causal-masked ``tokens x
    tokens`` block over the unmasked one's (Note [Masked blocks]). Empty: half, the masked
    block's share of the FLOPs."""
    enqueue: Enqueue | None = None
    """Host enqueue seconds per device operation, measured on a GPU (Note [Enqueue ahead]);
    ``None`` on a CPU host, whose host work ``host_call_s``/``host_post_s`` charge."""

    def __post_init__(self) -> None:
        _load_enqueue(self)
        if self.enqueue is not None and self.enqueue.any and self.shared_slots > 0:
            raise ValueError(
                "a profile with shared_slots > 0 (every rank on one CPU host) charges host work "
                "(host_call_s, host_post_s), not GPU enqueue costs; drop one of them"
            )
        # a profile read from JSON holds lists; the model is hashable and sorted by size
        cost = tuple(sorted((int(t), float(f), float(b)) for t, f, b in self.masked_cost))
        object.__setattr__(self, "masked_cost", cost)
        if not all(t > 0 and 0 < f < math.inf and 0 < b < math.inf for t, f, b in cost):
            raise ValueError(
                f"masked_cost {cost}: expected (tokens > 0, forward, backward) with each ratio "
                "of a masked block's time to an unmasked one's positive and finite; rerun "
                "megatron-charm-sim calibrate"
            )
        rates = (self.fwd_flops_per_s, self.bwd_flops_per_s, self.mem_bw)
        if not all(math.isfinite(x) and x > 0 for x in rates):
            raise ValueError(
                f"fitted rates must be > 0 (forward {self.fwd_flops_per_s}, backward "
                f"{self.bwd_flops_per_s} FLOP/s, merges {self.mem_bw} GB/s); rerun "
                "megatron-charm-sim calibrate or fix the profile"
            )
        if min(self.fwd_overhead, self.bwd_overhead) < 0:
            raise ValueError(
                f"per-block overheads must be >= 0 seconds (forward {self.fwd_overhead}, backward "
                f"{self.bwd_overhead}); fix compute.fwd_overhead/bwd_overhead in the --profile "
                "JSON or rerun megatron-charm-sim calibrate"
            )
        if not min(self.fwd_per_element, self.bwd_per_element) >= 0:
            raise ValueError(
                f"seconds per element (forward {self.fwd_per_element}, backward "
                f"{self.bwd_per_element}) must be >= 0; rerun megatron-charm-sim calibrate or "
                "fix the profile"
            )
        in_pass = (self.fwd_in_pass, self.bwd_in_pass)
        if not (math.isfinite(self.transport_in_pass) and self.transport_in_pass > 0):
            raise ValueError(
                f"the transport's CPU in a pass over its fit ({self.transport_in_pass}) must be "
                "finite and > 0; set compute.transport_in_pass in the --profile JSON to 1 or "
                "rerun megatron-charm-sim calibrate"
            )
        if not all(math.isfinite(x) and x > 0 for x in in_pass):
            raise ValueError(
                f"blocks in a pass over blocks alone (forward {self.fwd_in_pass}, backward "
                f"{self.bwd_in_pass}) must be finite and > 0; set compute.fwd_in_pass/"
                "bwd_in_pass in the --profile JSON to 1 or rerun megatron-charm-sim calibrate"
            )
        if min(self.fwd_slowdown, self.bwd_slowdown) < 1:
            raise ValueError(
                f"slowdowns under communication must be >= 1 (forward {self.fwd_slowdown}, "
                f"backward {self.bwd_slowdown}); set compute.fwd_slowdown/bwd_slowdown in the "
                "--profile JSON to 1 or more"
            )
        if not isinstance(self.sms, int) or self.sms < 0:
            raise ValueError(f"sms {self.sms!r} must be a non-negative integer; fix the profile")
        host = (self.host_call_s, self.host_post_s, self.host_byte_s)
        per_element = (self.host_element_fwd_s, self.host_element_bwd_s)
        if not min(*host, *per_element, self.transport_post_s, self.transport_byte_s) >= 0:
            raise ValueError(
                f"host work per pass {self.host_call_s} s, per exchange {self.host_post_s} s, "
                f"per byte {self.host_byte_s} s and per element {per_element} s, and the "
                f"transport's per exchange {self.transport_post_s} s and per byte "
                f"{self.transport_byte_s} s must be >= 0; fix the profile"
            )
        firsts = (self.host_first_fwd, self.host_first_bwd)
        if not all(0.0 <= x <= 1.0 for x in firsts):
            raise ValueError(
                f"host_first_fwd/host_first_bwd {firsts}: the share of a call's host work before "
                "its first instruction must lie in [0, 1]; fix the profile or rerun "
                "megatron-charm-sim calibrate"
            )
        if not self.shared_slots >= 0:
            raise ValueError(
                f"shared_slots={self.shared_slots}: expected >= 0 ranks (0: no shared host); "
                "fix the profile"
            )

    def host_slots(self) -> float:
        return self.shared_slots

    def host_work(self) -> tuple[float, float]:
        return self.host_call_s, self.host_post_s

    def host_per_byte(self) -> float:
        return self.host_byte_s

    def host_call_time(self, shape: AttnShape, backward: bool) -> float:
        per_element = self.host_element_bwd_s if backward else self.host_element_fwd_s
        return self.host_call_s + per_element * shape.b * shape.s_local * shape.h * shape.d

    def host_call_split(self, shape: AttnShape, backward: bool) -> tuple[float, float]:
        total = self.host_call_time(shape, backward)
        first = total * (self.host_first_bwd if backward else self.host_first_fwd)
        return first, total - first

    def transport_work(self) -> tuple[float, float]:
        k = self.transport_in_pass
        return self.transport_post_s * k, self.transport_byte_s * k

    def enqueue_cost(self) -> Enqueue:
        return self.enqueue or Enqueue()

    def in_pass(self, backward: bool) -> float:
        return self.bwd_in_pass if backward else self.fwd_in_pass

    def call_overhead(self, backward: bool) -> float:
        return (self.bwd_overhead if backward else self.fwd_overhead) * self.in_pass(backward)

    def block_time(self, ins: Compute, shape: AttnShape, backward: bool) -> float:
        return self.block_alone(ins, shape, backward) * self.in_pass(backward)

    def run_saving(self, run: Sequence[Compute], shape: AttnShape, backward: bool) -> float:
        if not self.sms:
            return 0.0
        saved = run_excess_flops(run, shape, backward, self.sms)
        if backward:
            return saved * BWD_FLOPS_RATIO / self.bwd_flops_per_s * self.in_pass(True)
        return saved / self.fwd_flops_per_s * self.in_pass(False)

    def block_alone(self, ins: Compute, shape: AttnShape, backward: bool) -> float:
        """The block's seconds as the kernel micro-benchmarks timed them, before
        :meth:`in_pass`."""
        if ins.masked and self.masked_cost:  # Note [Masked blocks]
            whole = dataclasses.replace(ins, masked=False)
            tokens = shape.s_local * ins.q_part.fraction
            return self.block_alone(whole, shape, backward) * self.masked_ratio(tokens, backward)
        flops = kernel_flops(ins, shape, backward, self.sms)  # Note [Tiles and waves]
        elements = block_elements(ins, shape)
        if backward:
            return (
                self.bwd_overhead + elements * self.bwd_per_element + flops / self.bwd_flops_per_s
            )
        return self.fwd_overhead + elements * self.fwd_per_element + flops / self.fwd_flops_per_s

    def masked_ratio(self, tokens: float, backward: bool) -> float:
        """A masked ``tokens x tokens`` block's time over the unmasked one's, interpolated
        linearly in ``log2(tokens)`` between the measured sizes, the nearest one outside them."""
        cost = self.masked_cost
        col = 2 if backward else 1
        if tokens <= cost[0][0]:
            return cost[0][col]
        for lo, hi in zip(cost, cost[1:], strict=False):
            if tokens <= hi[0] and hi[0] > lo[0]:
                w = math.log2(tokens / lo[0]) / math.log2(hi[0] / lo[0])
                return lo[col] + w * (hi[col] - lo[col])
        return cost[-1][col]

    def slowdown(self, backward: bool, held: int = 1) -> float:
        """The measured ratio, unless its cause runs in the replay (Note [Measured slowdown,
        modelled cause])."""
        if self.shared_slots > 0 and (self.transport_post_s > 0 or self.transport_byte_s > 0):
            return 1.0
        return self.bwd_slowdown if backward else self.fwd_slowdown


# Note [Measured slowdown, modelled cause]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``calibrate`` measures how much slower a block runs while its rank streams messages: on a GPU
# the SMs that NCCL's kernels take, on the CPU testbed the cores that gloo's transport threads
# take. A CPU profile with host work also charges those threads directly: while an exchange is
# in flight its transport work runs as a flow on the shared host and takes its share of the
# cores from every rank's blocks (Note [Host work of a call] in megatron_charm/sim/profile.py).
# Applying the measured ratio as well would charge the same cores twice, so such a profile's
# ``slowdown`` is 1 (the ratio stays in the profile, as measured). Testbed sweep of 2026-12-04:
# 167 of 174 times within +-20% with both, 168 (profile e) and 169 (f) with the cause alone
# (docs/results/calibrated-2x2.md).


# Note [Block shapes]
# ~~~~~~~~~~~~~~~~~~~
# A block's time is more than its FLOPs at a rate. A fitted profile prices three things that a
# kernel does, each fitted on timings over block shapes:
#
#     t = overhead + elements * per_element + flops / rate
#
# * ``overhead``: once per kernel call (dispatch, launch, allocations); a coalesced run of blocks
#   pays it once (Note [Coalesced blocks] in megatron_charm/plan/coalesce.py).
# * ``elements = b * d * (h * tq + h_kv * tk)``: the rows the kernel reads and writes. Work that
#   grows with them and not with their products: the softmax statistics of every query row, the
#   backward's float32 accumulators for dq, dk and dv and their conversion, each tile's loads.
# * ``flops``: the two matmuls of the forward, five of the backward (2.5 x).
#
# Timed at one head count only, the first two cannot be told apart well: the fit puts what does
# not grow with the FLOPs into the call (5.6 ms per backward block in the 2 x 2 testbed's profile
# of 2026-12-03 15:02 UTC, timed at 8 heads). Head-split methods (``a2a``, ``a2a+p2p``) run
# ``n`` times more calls on ``1/n`` of the heads, and their backward was predicted a median 28%
# too slow on that day's testbed sweep. ``calibrate`` therefore times each size at one head
# too (``--kernel-heads``). On the testbed host at 23:16 UTC a one-head backward block of 256
# tokens took 0.50 ms and an eight-head one 4.66 ms: a call + FLOPs fit on eight heads prices
# them at 2.97 and 4.56 ms, the fit on both at 0.52 and 4.15 ms (0 us per call, 10.5 ns per
# element). Over a sweep, the kernel time each method measured divided by its blocks' predicted
# time is then 1.8-2.1 for every method (four to eight ranks on two cores), where it was 0.8
# (a2a) to 1.9 (ring) with the old fit (docs/results/calibrated-2x2.md).


# Note [Masked blocks]
# ~~~~~~~~~~~~~~~~~~~~
# A causal-masked diagonal block computes half of a full block's FLOPs, but a kernel computes
# whole tiles: every tile that the diagonal crosses is computed in full. PyTorch's CPU flash
# kernel takes keys in tiles of up to 512 tokens, so a masked block of 512 tokens or fewer
# costs what an unmasked one does (measured on the testbed host, bf16, 4 heads of 64: 4.8 against
# 4.7 ms at 512 tokens, 0.70 of it at 1024), where the FLOPs say half. Zigzag plans put such
# blocks on every rank (a rank's own block, and the halves' diagonals), so the half rule made
# every causal method look faster than it runs. ``calibrate`` now times a masked block next to
# each unmasked one, and the model scales the unmasked time by the measured ratio at the
# block's size; flash-attention's 128-token tiles on a GPU give ratios near 0.5 at the sizes
# that matter, and profiles without the measurement keep the half rule.


ComputeModel = FlopsCompute | CalibratedCompute | FittedCompute


def describe_compute(compute: ComputeModel) -> str:
    """One line that states the compute model behind a prediction (tables and JSON)."""
    if isinstance(compute, FlopsCompute):
        rate = compute.tflops * compute.efficiency
        text = (
            f"{compute.tflops:g} TFLOPS x {compute.efficiency:g} efficiency = {rate:.4g} TFLOP/s "
            f"in blocks, backward {compute.bwd_ratio:g}x the forward's FLOPs"
        )
        if compute.sms:
            text += (
                f", as FlashAttention-2 tiles in waves over {compute.sms} SMs "
                f"({NCCL_P2P_CTAS} held per peer of an exchange in flight, at most "
                f"{NCCL_P2P_CHANNELS})"
            )
    elif isinstance(compute, FittedCompute):
        text = (
            f"fitted: forward {compute.fwd_flops_per_s / 1e12:.4g} TFLOP/s + "
            f"{compute.fwd_overhead * 1e6:.0f} us per block + "
            f"{compute.fwd_per_element * 1e9:.3g} ns per row element, backward "
            f"{compute.bwd_flops_per_s / 1e12:.4g} TFLOP/s + {compute.bwd_overhead * 1e6:.0f} us "
            f"+ {compute.bwd_per_element * 1e9:.3g} ns"
        )
        if compute.sms:
            text += f", FLOPs as tiles in waves over {compute.sms} SMs"
        if compute.transport_in_pass != 1.0:
            text += (
                f"; the transport's threads x{compute.transport_in_pass:.2f} in a pass (Note "
                "[Transport in a pass])"
            )
        if (compute.fwd_in_pass, compute.bwd_in_pass) != (1.0, 1.0):
            text += (
                f"; in a pass x{compute.fwd_in_pass:.2f} forward, x{compute.bwd_in_pass:.2f} "
                "backward (Note [Blocks in a pass])"
            )
    else:
        text = (
            f"measured full block: forward {compute.fwd_block * 1e3:.4g} ms, backward "
            f"{compute.bwd_block * 1e3:.4g} ms, scaled by area"
        )
    enq = compute.enqueue_cost()
    if enq.any:
        ops = (enq.call, enq.exchange, enq.kernel, enq.merge)
        text += "; host enqueue " + "/".join(f"{x * 1e6:.0f}" for x in ops)
        text += " us per pass/exchange/kernel call/merge"
    return text + f"; merges at {compute.mem_bw:g} GB/s"
