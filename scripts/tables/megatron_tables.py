#!/usr/bin/env python3
"""Tables 6 and 7 on patched Megatron-LM ``pretrain_gpt.py``: CHARM+ against TE's ring, on GPUs.

Plan, submit and read back the runs of :mod:`megatron_charm.megatron.tables`::

    # print every sbatch command and the pretrain_gpt.py line each job runs; submit nothing
    python scripts/tables/megatron_tables.py --table 6 --table 7 --dry-run \\
        --megatron-lm /path/to/patched/Megatron-LM --logs runs/megatron-tables

    # submit (one sbatch --wait per run, in order), then build the tables
    python scripts/tables/megatron_tables.py --table 7 --megatron-lm ... --logs ... \\
        --sbatch-arg=--partition=gpu

    # only build the tables from the logs of earlier runs
    python scripts/tables/megatron_tables.py --table 7 --collect-only --logs ...

Checkouts are patched with ``megatron-charm patch-megatron``. The CPU-scale tables
(``python -m megatron_charm.bench.tables --scale cpu``) are a different thing: megatron-charm's
own trainer on tiny stand-in models.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_charm.megatron.tables import (
    BASELINES,
    Cluster,
    markdown,
    parse_training_log,
    plan_cells,
    sbatch_argv,
    table_rows,
    torchrun_line,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", type=int, action="append", choices=(6, 7), required=True)
    p.add_argument("--baseline", action="append", choices=BASELINES, help="default: p2p")
    p.add_argument("--megatron-lm", default="$MEGATRON_LM", help="patched Megatron-LM checkout")
    p.add_argument("--logs", type=Path, required=True, help="folder of the jobs' output")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--cpus-per-node", type=int, default=64, help="Slurm CPU request per node")
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="iterations left out of the timing")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the batch")
    p.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch option")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the commands only")
    mode.add_argument("--collect-only", action="store_true", help="only read existing logs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    baselines = args.baseline or ["p2p"]
    cluster = Cluster(args.nodes, args.gpus_per_node, args.cpus_per_node)
    run = {"train_iters": args.train_iters, "micro_batch_size": args.micro_batch_size}
    try:
        cells = plan_cells(sorted(set(args.table)), baselines)
        commands = [
            sbatch_argv(cell, cluster, args.megatron_lm, str(args.logs), args.sbatch_arg, **run)
            for cell in cells
        ]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for cell, command in zip(cells, commands, strict=True):
            print(f"# {cell.run_id}")
            print(shlex.join(command))
            print(
                "#   each node runs: "
                + " ".join(torchrun_line(cell, cluster, args.megatron_lm, **run))
            )
        return 0
    if not args.collect_only:
        args.logs.mkdir(parents=True, exist_ok=True)
        for cell, command in zip(cells, commands, strict=True):
            print(f"{cell.run_id}: submitting", flush=True)
            if subprocess.run(command).returncode != 0:
                print(f"{cell.run_id}: the job failed; see its log", file=sys.stderr)
    summaries = {}
    for cell in cells:
        log = args.logs / f"{cell.run_id}.log"
        if not log.is_file():
            print(f"{cell.run_id}: no log at {log}; left out", file=sys.stderr)
            continue
        try:
            summaries[cell] = parse_training_log(log.read_text(), cell.seq, args.warmup)
        except ValueError as exc:
            print(f"{cell.run_id}: {exc}; left out", file=sys.stderr)
    for baseline in baselines:
        for table in sorted(set(args.table)):
            rows = [r for r in table_rows(summaries, baseline) if r["table"] == table]
            gpus = cluster.world_size
            text = f"# Table {table} (Megatron-LM, {gpus} GPUs, CP {gpus}): {baseline} vs CHARM+\n"
            text += "\n"
            text += markdown(rows, baseline)
            out = args.logs / f"table{table}-megatron-{baseline}.md"
            out.write_text(text)
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
