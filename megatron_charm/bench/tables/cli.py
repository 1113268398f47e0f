"""Command line of the end-to-end tables (``python -m megatron_charm.bench.tables``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_charm.bench.tables.collect import collect
from megatron_charm.bench.tables.plan import MODELS, SCALES, Scale, plan_runs
from megatron_charm.bench.tables.render import (
    describe_code,
    describe_machine,
    markdown_document,
    markdown_table,
    write_csv,
)
from megatron_charm.bench.tables.runner import execute, launch_command

#: How the tables' own documents quote the command that made them.
COMMAND = ("python", "-m", "megatron_charm.bench.tables")


def make_scale(args: argparse.Namespace) -> Scale:
    """The scale of ``--scale``, with the command line's changes."""
    scale = SCALES[args.scale]
    for flag in ("nodes", "ranks_per_node", "train_iters", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:  # 0 used to fall back to the scale's default
            raise ValueError(
                f"--{flag.replace('_', '-')} {value} must be >= 1; leave it out for the "
                f"{scale.name} scale's {getattr(scale, flag)}"
            )

    def given(flag: str) -> int:
        value = getattr(args, flag)
        return getattr(scale, flag) if value is None else value

    return Scale(
        scale.name,
        given("nodes"),
        given("ranks_per_node"),
        given("train_iters"),
        scale.warmup if args.warmup is None else args.warmup,
        scale.seq_divisor,
        given("repeats"),
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m megatron_charm.bench.tables``."""
    p = argparse.ArgumentParser(
        prog="python -m megatron_charm.bench.tables",
        description="Reproduce the paper's end-to-end Tables 6 and 7 with megatron-charm-train.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scale", choices=("cpu", "gpu"), required=True)
    p.add_argument("--table", choices=("6", "7", "all"), default="all")
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default: runs/tables-SCALE)"
    )
    p.add_argument(
        "--launcher",
        choices=("fork", "local", "torchrun", "slurm", "testbed"),
        default=None,
        help="fork (cpu default): ranks forked from this process, which imports the trainer "
        "once; local: one `python -m megatron_charm.train` per run, which starts its own ranks; "
        "torchrun: scripts/launch/torchrun_train.sh per run on this node; slurm (gpu default): "
        "`sbatch --wait scripts/launch/slurm_train.sbatch` per run; testbed (cpu, root): the "
        "ranks in emulated nodes joined by a --cross-rate link (docs/testbed.md)",
    )
    p.add_argument("--cross-rate", default="100mbit", help="testbed: cross link rate per direction")
    p.add_argument("--topology", choices=("shared", "rails"), default="shared", help="testbed")
    p.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="where the CSV and markdown tables go (default: --out)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument(
        "--collect-only", action="store_true", help="only build the tables from existing runs"
    )
    p.add_argument(
        "--skip-existing", action="store_true", help="do not re-run runs that already completed"
    )
    p.add_argument("--baseline", default="ring", help="method of the baseline column (ring; p2p)")
    p.add_argument("--model", action="append", choices=sorted(MODELS), help="only these models")
    p.add_argument(
        "--shape",
        action="append",
        metavar="BxS",
        help="only these rows, as the paper's batch x seq (e.g. 16x2048); repeatable",
    )
    p.add_argument("--nodes", type=int, help="nodes (gpu default 2; cpu: emulated, default 2)")
    p.add_argument("--ranks-per-node", type=int, help="GPUs per node (gpu default 8; cpu 2)")
    p.add_argument("--train-iters", type=int, help="iterations per run (gpu 30, cpu 16)")
    p.add_argument("--warmup", type=int, help="iterations left out of the median (gpu 10, cpu 4)")
    p.add_argument(
        "--repeats", type=int, help="runs per cell and method, interleaved (gpu 1, cpu 2)"
    )
    p.add_argument("--micro-batch-size", type=int, help="accumulate over micro-batches this big")
    p.add_argument("--label", help="hardware name in Table 7's headers (default: cpu or GPU)")
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        help="extra sbatch option, e.g. --sbatch-arg=--partition=gpu (repeatable)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (cpu 600)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="added to every run")
    return p


def _parse_shapes(items: Sequence[str] | None) -> list[tuple[int, int]] | None:
    if not items:
        return None
    shapes = []
    for item in items:
        try:
            b, s = item.lower().split("x")
            shapes.append((int(b), int(s)))
        except ValueError:
            raise SystemExit(f"error: --shape {item!r} must look like 16x2048") from None
    return shapes


@contextlib.contextmanager
def _testbed(launcher: str, scale, args: argparse.Namespace):
    """An up testbed of the scale's shape for ``--launcher testbed``, else ``None``."""
    if launcher != "testbed":
        yield None
        return
    from megatron_charm.testbed import Testbed

    with Testbed(
        nodes=scale.nodes,
        ranks_per_node=scale.ranks_per_node,
        topology=args.topology,
        cross_rate=args.cross_rate,
    ) as tb:
        yield tb


def main(argv: Sequence[str] | None = None) -> int:
    """Plan, run, collect and write the tables; the exit status is 1 if a run failed."""
    args = build_parser().parse_args(argv)
    try:
        scale = make_scale(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if scale.train_iters <= scale.warmup:
        print("error: --train-iters must exceed --warmup", file=sys.stderr)
        return 2
    tables = (6, 7) if args.table == "all" else (int(args.table),)
    launcher = args.launcher or ("fork" if scale.name == "cpu" else "slurm")
    if launcher in ("fork", "local") and scale.name == "gpu":
        print(
            "note: fork/local start every rank on this machine; the gpu scale needs "
            f"{scale.world_size} GPUs",
            file=sys.stderr,
        )
    out = args.out or Path("runs") / f"tables-{scale.name}"
    label = args.label or ("cpu" if scale.name == "cpu" else "GPU")
    if args.baseline == "charm":
        print(
            "error: --baseline must be another method than charm (ring, p2p, ...)", file=sys.stderr
        )
        return 2
    methods = [args.baseline, "charm"]
    try:
        runs = plan_runs(
            tables,
            scale,
            methods,
            out,
            models=args.model,
            shapes=_parse_shapes(args.shape),
            micro_batch_size=args.micro_batch_size,
            extra=args.overrides,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not runs:
        print("error: --model/--shape select no run", file=sys.stderr)
        return 2

    if args.dry_run:
        again = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--dry-run"]
        print(f"# {len(runs)} runs, {scale.world_size} ranks each, one after another. Afterwards:")
        print("#   " + shlex.join([*COMMAND, *again, "--collect-only"]))
        for run in runs:
            print(shlex.join(launch_command(run, launcher, scale, args.sbatch_arg)))
        return 0

    errors: dict[str, str] = {}
    began = time.monotonic()
    load_before = os.getloadavg()[0]
    # Recorded before the runs: the code they import is the code at this moment.
    code = describe_code()
    if args.collect_only:
        code += " at collection time (the runs may have used other code)"
    if not args.collect_only:
        timeout = args.timeout or (600.0 if scale.name == "cpu" else 4 * 3600.0)
        with _testbed(launcher, scale, args) as testbed:
            errors = execute(
                runs, launcher, scale, args.sbatch_arg, timeout, args.skip_existing, testbed
            )
    rows = collect(runs, scale, errors)

    results_dir = args.results_dir or out
    results_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join([*COMMAND, *(argv or sys.argv[1:])])
    link = None
    if launcher == "testbed":
        link = f"emulated nodes, {args.topology} cross links at {args.cross_rate} per direction"
    machine = describe_machine(scale, link)
    if launcher in ("fork", "local", "testbed") and not args.collect_only:
        # Other work on the machine shows in the timings; say how busy it was.
        machine += (
            f"; 1-minute load average {load_before:.1f} before and "
            f"{os.getloadavg()[0]:.1f} after the runs"
        )
    for number in tables:
        table_rows = [r for r in rows if r.table == number]
        if not table_rows:
            continue
        stem = results_dir / f"table{number}-{scale.name}"
        write_csv(stem.with_suffix(".csv"), table_rows, args.baseline)
        doc = markdown_document(
            number, table_rows, args.baseline, label, scale, command, machine, code
        )
        stem.with_suffix(".md").write_text(doc)
        print(f"\nTable {number} -> {stem}.csv, {stem}.md\n")
        print(markdown_table(number, table_rows, args.baseline, label))
    failed = sum(len(r.errors) for r in rows)
    print(f"{len(runs)} runs, {failed} failed, {time.monotonic() - began:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
