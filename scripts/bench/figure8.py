"""The paper's Figure 8: RM+'s forward speedup over ring on one node of 4 L20 and of 4 H20.

The paper's Figure 8 plots RM+'s forward against Ring-Attention's on 4 L20 GPUs (one PCIe NUMA
domain) and 4 H20 GPUs (NVLink) over batch sizes and sequences of about 10K-60K tokens; its text
(section 4.5): on L20 "link contention degrades performance in almost all configurations. The
exception occurs when both the batch size and sequence length are small", and RM+ does better on
H20. The figure's values are not in the text, so this prints the replay's speedups over the same
ranges for a reader to hold against the figure; nothing is fitted on it.

Both baselines as the paper ran them (Note [The paper's baselines] in
``megatron_charm/sim/baselines.py``), on the presets, 12 heads of 128 (the validation's
assumption for Table 4, which states neither), non-causal.

Run: ``python scripts/bench/figure8.py [--set GPU.FIELD=VALUE ...] [--md FILE]`` (about 10 s;
``--set`` as in ``megatron_charm.sim.validation``).
"""

from __future__ import annotations

import argparse
import datetime

from megatron_charm.bench.report import emit
from megatron_charm.sim.baselines import paper_predict
from megatron_charm.sim.predict import Prediction, Problem
from megatron_charm.sim.topology import Hardware
from megatron_charm.sim.validation import set_fields

SEQS = (1792, 7168, 16384, 32768, 65536)
BATCHES = (1, 2, 4, 8, 16)
HEADS, HEAD_DIM = 12, 128


def speedups(hw: Hardware, batch: int) -> list[float]:
    """RM+'s forward speedup over ring on one node of 4 ``hw`` GPUs at every :data:`SEQS`."""
    topo = hw.topology(1, 4)
    compute = hw.compute_model(hw.efficiency)
    out = []
    for seq in SEQS:
        pred = paper_predict(topo, Problem(batch, seq, HEADS, HEAD_DIM), compute, ("ring", "rm+"))
        out.append(pred.methods["ring"].forward.makespan / pred.methods["rm+"].forward.makespan)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="GPU.FIELD=VALUE")
    ap.add_argument("--md", help="write the table here as well")
    args = ap.parse_args()
    try:
        presets = set_fields(args.set)
    except ValueError as err:
        ap.error(str(err))
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"RM+'s forward speedup over ring, 1 x 4, {HEADS} x {HEAD_DIM} heads, non-causal, the "
        f"paper's baselines on the presets; unit: {Prediction.UNIT} ({now:%Y-%m-%d %H:%M} UTC)"
        + (f"; preset fields set: {', '.join(args.set)}" if args.set else ""),
        "",
        "| GPU | batch | " + " | ".join(f"{s:,} tokens" for s in SEQS) + " |",
        "|---|---|" + "---|" * len(SEQS),
    ]
    for gpu in ("L20", "H20"):
        for batch in BATCHES:
            cells = " | ".join(f"{x:.2f}" for x in speedups(presets[gpu], batch))
            lines.append(f"| {gpu} | {batch} | {cells} |")
    text = "\n".join(lines)
    emit(text, args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
