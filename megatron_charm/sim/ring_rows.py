"""A GPU system's constants from the paper's own ring rows.

Note [Constants from the ring rows]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The paper publishes ring's forward times next to every speedup. Ring is the baseline, and its
forward (the paper's runs it without overlap, Note [The paper's baselines] in
:mod:`megatron_charm.sim.baselines`) is a sum that the simulator's model states term by term. On
``n`` ranks of local length ``s = S / n``, per rank::

    T = n * 4 s^2 w / (F * eff)                         its n blocks at the achieved rate
      + (n - 1) * (lat + 2 s w * 2 bytes / rate)        its n - 1 kv transfers, one at a time

with ``w = batch x heads x head dim`` and ``F`` Table 2's TFLOPS. On one node the transfers are
intra-node; across two nodes every step waits for the transfer that crosses. So ring rows alone
give a GPU's efficiency, its point-to-point rate and its fixed cost per transfer, without any
speedup: those stay predictions.

H20 (Table 4; its batch and heads are not stated, and the validation's 16 x 12 x 128 is used):

* one node, four rows (1 x 4 and 1 x 8 at 1,792 and 7,168 tokens), three unknowns, least squares
  on relative residuals: efficiency 0.329, intra-node rate 45.5 GB/s (0.153 of Table 2's
  297.2), 0.196 ms per transfer;
* two nodes, two rows, the efficiency above: 1.09 ms per cross-node transfer at 10.7 GB/s
  (0.251 of Table 2's 42.6).

Replayed, ring's six H20 times land within 7% of the paper's (they were 3-7 times too fast
with Table 2's rates, 5-10 us latencies and an efficiency fitted on the speedups). The fixed
costs are ms, not the us of a link: whatever each step of the paper's H20 runs costs beyond its
bytes (the per-step work of its implementation, its cluster's network). The efficiency and the
rates depend on the assumed batch and heads (at 16 x 20 x 192: 0.82, 0.38 and 0.63); the fixed
costs do not. Whether a fixed cost is a delay or time on the link, and how many cross links a
node has, they cannot tell (one transfer leaves a node at a time); the two-node RM+ and CHARM+
rows can (Note [A fixed cost on the link] in :mod:`megatron_charm.sim.topology`). H100's cross
rate is read the same way from Table 5
(whose transfers are large enough that a fixed cost cannot be told apart from the rate). L20 has
only two one-node rows, too few for three unknowns; its efficiency stays fitted on its speedups.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_charm.plan.payloads import payload_bytes
from megatron_charm.plan.types import Kind, Part, Payload, Wire
from megatron_charm.sim.compute import block_flops
from megatron_charm.sim.profile import FULL_BLOCK, fit_nonnegative, sample_shape
from megatron_charm.sim.topology import PRESETS
from megatron_charm.sim.validation import PAPER_ROWS, PaperRow


@dataclass(frozen=True)
class RingConstants:
    """What a GPU's ring rows give (Note [Constants from the ring rows])."""

    efficiency: float
    """Achieved fraction of Table 2's TFLOPS in blocks."""
    intra_rate: float
    """Fraction of Table 2's intra-node bandwidth that one transfer achieves."""
    intra_lat: float
    """Seconds of fixed cost per intra-node transfer."""
    cross_rate: float
    """Fraction of Table 2's cross-node bandwidth that one transfer achieves."""
    cross_lat: float
    """Seconds of fixed cost per cross-node transfer."""


def _terms(row: PaperRow) -> tuple[int, float, float]:
    """``(n, FLOPs of one block, kv bytes of one transfer)`` of ``row``'s ring, as the replay
    counts them (bf16 kv)."""
    n = row.gpus[0] * row.gpus[1]
    shape = sample_shape(row.batch, row.heads, row.head_dim, row.seq // n)
    kv = payload_bytes(Payload(Kind.KV, 0, Part.FULL), shape, Wire.INPUT)
    return n, block_flops(FULL_BLOCK, shape, False), float(kv)


def ring_constants(gpu: str) -> RingConstants:
    """``gpu``'s constants from its one-node and two-node ring rows in :data:`PAPER_ROWS`."""
    hw = PRESETS[gpu]
    rows = [r for r in PAPER_ROWS if r.gpu == gpu and r.ring_fwd is not None]
    one = [r for r in rows if r.gpus[0] == 1]
    two = [r for r in rows if r.gpus[0] == 2]
    if len(one) < 3 or len(two) < 2:
        raise ValueError(
            f"{gpu}: ring rows on one node ({len(one)}) and two nodes ({len(two)}) must be at "
            "least 3 and 2 to give an efficiency, rates and fixed costs"
        )
    feats, ys = [], []
    for row in one:
        n, flops, kv = _terms(row)
        feats.append((n * flops / (hw.tflops * 1e12), (n - 1) * kv / (hw.intra_bw * 1e9), n - 1))
        ys.append(row.ring_fwd * 1e-3)  # type: ignore[operator]
    inv_eff, inv_intra, intra_lat = fit_nonnegative(feats, ys, drop_order=())
    feats, ys = [], []
    for row in two:
        n, flops, kv = _terms(row)
        blocks = n * flops / (hw.tflops * 1e12) * inv_eff
        feats.append(((n - 1) * kv / (hw.cross_bw * 1e9), n - 1))
        ys.append(row.ring_fwd * 1e-3 - blocks)  # type: ignore[operator]
    inv_cross, cross_lat = fit_nonnegative(feats, ys, drop_order=())
    return RingConstants(1 / inv_eff, 1 / inv_intra, intra_lat, 1 / inv_cross, cross_lat)
