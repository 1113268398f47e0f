#!/usr/bin/env python3
"""Host seconds per instruction of our executor, from the attention benchmark's traces: the
median time of each posted exchange, kernel call and merge, per method and pass, on every rank.

At tiny shapes nearly all of it is host work: the bound docs/simulator.md ("Enqueue ahead")
uses for the presets' enqueue cost. Run the benchmark with ``--raw`` first:

    python -m megatron_charm.bench attention --launcher loopback --nodes 2 --ranks-per-node 1 \\
        --seq-local 16 --heads 1 --head-dim 8 --dtype fp32 --no-causal --methods ring,charm \\
        --iters 20 --warmup 3 --raw raw.json
    python scripts/bench/host_per_op.py raw.json [--md FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from megatron_charm.bench.report import emit

KINDS = ("Exchange", "Compute", "Merge")


def table(raw: dict) -> str:
    """One row per method, pass and rank: median microseconds per kind, and the count per call."""
    lines = [
        "| method | pass | cp_rank | exchange us (n) | kernel us (n) | merge us (n) |",
        "|---|---|---|---|---|---|",
    ]
    methods = sorted({m for per_rank in raw["ranks"] for m in per_rank["recs"]})
    for method in methods:
        for tag in ("fwd", "bwd"):
            for per_rank in raw["ranks"]:
                calls = per_rank["recs"][method]["fwdbwd"]
                got: dict[str, list[float]] = {k: [] for k in KINDS}
                for rec in calls:
                    for pass_tag, kind, _, start, end in rec["events"]:
                        if pass_tag == tag and kind in got:
                            got[kind].append(end - start)
                cells = [
                    f"{statistics.median(v) * 1e6:.0f} ({len(v) // len(calls)})" if v else "-"
                    for v in got.values()
                ]
                lines.append(
                    f"| {method} | {tag} | {per_rank['cp_rank']} | " + " | ".join(cells) + " |"
                )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path, help="the benchmark's --raw JSON")
    ap.add_argument("--md", type=Path, help="write the table here as well")
    args = ap.parse_args()
    text = table(json.loads(args.raw.read_text()))
    emit(text, args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
