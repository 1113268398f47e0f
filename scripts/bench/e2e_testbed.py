#!/usr/bin/env python3
"""End to end on the emulated testbed: ring against CHARM+ iterations over cross-link rates.

Runs ``python -m megatron_charm.bench.tables --scale cpu --table 6 --launcher testbed`` (the
paper's Table 6 shapes at CPU scale, ``megatron-charm-train`` on 2 emulated nodes x 2 ranks) once
per cross-link rate, then writes one table: rate x shape, ring and CHARM+ median iteration times,
speedup, and whether the final losses agree. Needs root (docs/testbed.md).

    python scripts/bench/e2e_testbed.py --out runs/e2e-testbed --md docs/results/e2e-testbed.md
    python scripts/bench/e2e_testbed.py --rates 100mbit --shape 2x16384 model.num_query_groups=1
"""

from __future__ import annotations

import argparse
import csv
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from megatron_charm.bench.report import emit

RATES = "1gbit,400mbit,100mbit,50mbit"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default=RATES, help=f"comma-separated tc rates (default {RATES})")
    ap.add_argument(
        "--shape",
        action="append",
        help="the paper's batch x seq (default 2x16384 and 16x2048); repeatable",
    )
    ap.add_argument("--model", default="gpt-350m")
    ap.add_argument("--repeats", type=int, default=1, help="runs per cell and method")
    ap.add_argument("--out", type=Path, default=Path("runs/e2e-testbed"))
    ap.add_argument("--md", type=Path, help="write the combined table here")
    ap.add_argument("overrides", nargs="*", help="section.key=value added to every run")
    args = ap.parse_args(argv)
    shapes = args.shape or ["2x16384", "16x2048"]
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows, failed = [], 0
    for rate in [r.strip() for r in args.rates.split(",") if r.strip()]:
        out = args.out / rate
        cmd = [sys.executable, "-m", "megatron_charm.bench.tables", "--scale", "cpu"]
        cmd += ["--table", "6", "--launcher", "testbed", "--cross-rate", rate]
        cmd += ["--model", args.model, "--repeats", str(args.repeats), "--out", str(out)]
        for shape in shapes:
            cmd += ["--shape", shape]
        cmd += args.overrides
        print("$ " + shlex.join(cmd), flush=True)
        failed += subprocess.run(cmd).returncode != 0
        with open(out / "table6-cpu.csv") as fh:
            for row in csv.DictReader(fh):
                rows.append({"rate": rate, **row})
    lines = [
        f"Started {started}. Command: `python scripts/bench/e2e_testbed.py "
        f"{shlex.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        "| cross link | batch x seq | model | ring ms/iter | CHARM+ ms/iter | speedup | "
        "final loss ring / CHARM+ |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['batch_size']} x {r['seq_length']} | {r['model']} | "
            f"{r['baseline_latency_ms']} | {r['charm_latency_ms']} | {r['speedup']}x | "
            f"{r['baseline_final_loss']} / {r['charm_final_loss']} |"
        )
    text = "\n".join(lines) + "\n"
    emit(text, args.md)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
