#!/usr/bin/env python3
"""Reproduce the paper's end-to-end tables (Table 6 and Table 7) with ``megatron-charm-train``.

Every cell pair (ring, CHARM+) is one trainer run of the same config with ``section.key=value``
overrides; the per-iteration times and peak memory come from each run's ``metrics.jsonl``. The
script writes, per table, a CSV and a markdown table laid out like the paper's, with the speedup
column (ring latency / CHARM+ latency).

* Table 6: GPT-350M and GPT-1.3B, batch x seq in {16x2048, 8x4096, 4x8192, 2x16384}, ring vs
  CHARM+, iteration latency (ms) and memory (MB); the paper ran it on 16 L20 GPUs.
* Table 7: GPT3-350M, batch x seq in {16x16384, 32x8192, 64x4096, 128x2048}, ring vs CHARM+,
  iteration latency (ms); the paper ran it on 16 H20 and on 16 H100 GPUs.

Scales:

* ``--scale gpu``: the paper's sizes on 16 GPUs (2 nodes x 8, CP = 16, as the paper runs CP over
  all 16 GPUs). Launched with Slurm (``scripts/launch/slurm_train.sbatch``, one ``sbatch --wait``
  per run) or torchrun (``scripts/launch/torchrun_train.sh``); ``--dry-run`` prints the commands,
  ``--collect-only`` builds the tables from run directories that already exist.
* ``--scale cpu``: tiny stand-in models (``configs/tables/cpu-*.yaml``), 4 CPU ranks (gloo, CP = 4
  as 2 emulated nodes x 2), sequence lengths divided by 16 and the same batch sizes, so the tables
  keep the paper's shapes. It proves the pipeline end to end in a few minutes on 2 cores.

Examples::

    python scripts/tables/e2e_tables.py --scale cpu --out runs/tables-cpu
    python scripts/tables/e2e_tables.py --scale gpu --table 7 --dry-run
    python scripts/tables/e2e_tables.py --scale gpu --launcher slurm --out /shared/tables \\
        --sbatch-arg=--partition=gpu --label H100
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN_MODULE = "megatron_charm.train"

#: The paper's rows: (batch size, sequence length).
TABLE6_SHAPES = ((16, 2048), (8, 4096), (4, 8192), (2, 16384))
TABLE7_SHAPES = ((16, 16384), (32, 8192), (64, 4096), (128, 2048))
#: Sequence lengths are divided by this at --scale cpu (batch sizes stay as in the paper).
CPU_SEQ_DIVISOR = 16

METHOD_TITLES = {"ring": "Ring", "charm": "CHARM+", "p2p": "Ring (TE p2p)"}


@dataclass(frozen=True)
class Model:
    """A table's model: the paper's name and the config that stands for it at each scale."""

    name: str
    gpu_config: str
    cpu_config: str


MODELS = {
    "gpt-350m": Model("GPT-350M", "configs/gpt-350m.yaml", "configs/tables/cpu-350m.yaml"),
    "gpt-1.3b": Model("GPT-1.3B", "configs/gpt-1.3b.yaml", "configs/tables/cpu-1.3b.yaml"),
}


@dataclass(frozen=True)
class TableSpec:
    number: int
    title: str
    models: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]
    model_label: dict[str, str]
    with_memory: bool


TABLES = {
    6: TableSpec(
        6,
        "End-to-end performance of Ring-Attention and CHARM+ with model scaling",
        ("gpt-350m", "gpt-1.3b"),
        TABLE6_SHAPES,
        {"gpt-350m": "GPT-350M", "gpt-1.3b": "GPT-1.3B"},
        with_memory=True,
    ),
    7: TableSpec(
        7,
        "End-to-end performance of Ring-Attention and CHARM+ (GPT3-350M)",
        ("gpt-350m",),
        TABLE7_SHAPES,
        {"gpt-350m": "GPT3-350M"},
        with_memory=False,
    ),
}


@dataclass(frozen=True)
class Scale:
    """Where the runs go: ranks, CP split and iteration counts."""

    name: str
    nodes: int
    ranks_per_node: int
    train_iters: int
    warmup: int
    seq_divisor: int
    repeats: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def make_scale(args: argparse.Namespace) -> Scale:
    if args.scale == "cpu":
        # 4 ranks as 2 emulated nodes x 2: CHARM+ takes the cross-node path, as on 2 x 8 GPUs.
        # Two interleaved repeats per cell: other work on a shared machine then slows both
        # methods alike instead of one of them.
        scale = Scale("cpu", 2, 2, 16, 4, CPU_SEQ_DIVISOR, repeats=2)
    else:
        # The paper: 16 GPUs (Table 6: L20; Table 7: H20 and H100), context parallelism over all.
        scale = Scale("gpu", 2, 8, 30, 10, 1, repeats=1)
    return Scale(
        scale.name,
        args.nodes or scale.nodes,
        args.ranks_per_node or scale.ranks_per_node,
        args.train_iters or scale.train_iters,
        scale.warmup if args.warmup is None else args.warmup,
        scale.seq_divisor,
        args.repeats or scale.repeats,
    )


@dataclass
class Run:
    """One trainer invocation: one cell of a table for one method."""

    table: int
    model: str
    batch: int
    seq: int
    method: str
    config: str
    overrides: list[str]
    run_dir: Path
    repeat: int = 1

    @property
    def run_id(self) -> str:
        return self.run_dir.name


@dataclass
class Result:
    """What one run's metrics.jsonl says, after the warm-up iterations."""

    iter_ms_median: float
    iter_ms_mean: float
    peak_mem_mb: float
    tokens_per_s: float
    measured: int
    final_loss: float


@dataclass
class Row:
    table: int
    model: str
    batch: int
    seq: int
    results: dict[str, Result | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def _yaml_string(text: str) -> str:
    """``text`` as an override value: plain when YAML reads it back unchanged, else quoted."""
    import yaml

    return text if yaml.safe_load(text) == text else repr(text)


def plan_runs(
    tables: Sequence[int],
    scale: Scale,
    methods: Sequence[str],
    out: Path,
    models: Sequence[str] | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
    micro_batch_size: int | None = None,
    extra: Sequence[str] = (),
) -> list[Run]:
    """Every run of the requested tables, in table order (baseline before CHARM+ per row)."""
    runs = []
    cp = scale.world_size
    for number in tables:
        spec = TABLES[number]
        for model in spec.models:
            if models and model not in models:
                continue
            for batch, paper_seq in spec.shapes:
                if shapes and (batch, paper_seq) not in shapes:
                    continue
                seq = paper_seq // scale.seq_divisor
                if seq % (2 * cp):
                    raise ValueError(f"sequence length {seq} is not divisible by 2 x CP = {2 * cp}")
                # CP over every rank (DP = 1), so a micro-batch is the whole batch unless the user
                # accumulates gradients over smaller ones to save memory.
                mbs = micro_batch_size or batch
                if batch % mbs:
                    raise ValueError(f"--micro-batch-size {mbs} does not divide batch {batch}")
                cfg = MODELS[model].cpu_config if scale.name == "cpu" else MODELS[model].gpu_config
                for repeat, method in itertools.product(range(1, scale.repeats + 1), methods):
                    run_id = f"table{number}-{model}-b{batch}-s{seq}-{method}"
                    if scale.repeats > 1:
                        run_id += f"-r{repeat}"
                    run_dir = (out / "runs" / run_id).resolve()
                    overrides = [
                        f"run.name={run_id}",
                        f"run.dir={_yaml_string(str(run_dir))}",
                        f"parallel.cp_comm_type={method}",
                        f"parallel.context_parallel_size={cp}",
                        f"parallel.ranks_per_node={scale.ranks_per_node}",
                        f"parallel.nproc={cp}",
                        f"model.seq_length={seq}",
                        f"train.global_batch_size={batch}",
                        f"train.micro_batch_size={mbs}",
                        f"train.train_iters={scale.train_iters}",
                        # The configs' warm-up is longer than a timing run; the schedule does not
                        # change the cost of an iteration.
                        "train.lr_warmup_iters=1",
                        "data.kind=mock",
                        "checkpoint.save=false",
                        "checkpoint.resume=false",
                        "logging.log_interval=1",
                        *extra,
                    ]
                    runs.append(
                        Run(number, model, batch, seq, method, cfg, overrides, run_dir, repeat)
                    )
    return runs


# --- launching -------------------------------------------------------------------------------


def trainer_argv(run: Run) -> list[str]:
    """Arguments of ``megatron-charm-train`` for a run (the config as an absolute path)."""
    return ["--config", str(REPO / run.config), *run.overrides]


def launch_command(run: Run, launcher: str, scale: Scale, sbatch_args: Sequence[str]) -> list[str]:
    """The shell command that performs ``run`` with ``launcher``."""
    argv = trainer_argv(run)
    if launcher in ("local", "fork"):
        return [sys.executable, "-m", TRAIN_MODULE, *argv]
    # At --scale cpu the nodes are emulated (parallel.ranks_per_node): every rank runs on one
    # machine. At --scale gpu each node runs ranks_per_node ranks, one per GPU.
    emulated = scale.name == "cpu"
    per_node = scale.world_size if emulated else scale.ranks_per_node
    if launcher == "torchrun":
        # One node per invocation: for several nodes run this script on each with NNODES,
        # MASTER_ADDR and RDZV_ID set (scripts/launch/torchrun_train.sh joins them).
        script = str(REPO / "scripts/launch/torchrun_train.sh")
        return ["bash", script, "--nproc", str(per_node), *argv[1:]]
    if launcher == "slurm":
        script = str(REPO / "scripts/launch/slurm_train.sbatch")
        where = (
            ["--nodes=1", f"--cpus-per-task={per_node}"]
            if emulated
            else [f"--nodes={scale.nodes}", f"--gpus-per-node={per_node}"]
        )
        return [
            "sbatch",
            "--wait",
            f"--job-name={run.run_id}",
            *where,
            "--ntasks-per-node=1",
            # torchrun mode of the sbatch script: one torchrun per node starts the node's ranks.
            f"--export=ALL,NPROC_PER_NODE={per_node}",
            f"--output={run.run_dir}/slurm-%j.out",
            *sbatch_args,
            script,
            *argv[1:],
        ]
    raise ValueError(f"unknown launcher {launcher!r}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ForkRunner:
    """Runs the trainer's entry point in ranks forked from a process that imported it once.

    Each run is ``megatron_charm.train.cli.main(argv)`` with the very argv of the command line,
    in ``nproc`` freshly forked ranks with their own rendezvous port, exactly as the trainer's
    own launcher sets them up. Forking skips the import of torch and megatron-core per rank
    (tens of seconds per run on 2 cores); a fresh process per run keeps peak-memory readings
    (``ru_maxrss``) per run instead of per pool.
    """

    def __init__(self) -> None:
        # Keep the parent single-threaded before forking: a started OpenMP pool does not
        # survive fork.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import warnings

        warnings.filterwarnings("ignore")
        import torch

        torch.set_num_threads(1)
        # Imported once here, so that the forked ranks find them loaded.
        import megatron.core.models.gpt  # noqa: F401

        import megatron_charm.megatron  # noqa: F401
        from megatron_charm.train import cli, loop  # noqa: F401

    def run(self, run: Run, nproc: int, log: Path, timeout_s: float) -> int:
        argv = trainer_argv(run)
        port = _free_port()
        pids = []
        with log.open("w") as out:
            out.write("$ " + shlex.join([sys.executable, "-m", TRAIN_MODULE, *argv]) + "\n")
            out.flush()
            for rank in range(nproc):
                pid = os.fork()
                if pid == 0:  # the rank
                    code = 1
                    try:
                        os.dup2(out.fileno(), 1)
                        os.dup2(out.fileno(), 2)
                        os.environ.update(
                            RANK=str(rank),
                            WORLD_SIZE=str(nproc),
                            LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(nproc),
                            MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port),
                        )
                        from megatron_charm.train.cli import main

                        code = main(argv)
                    except BaseException:  # noqa: BLE001 - report, then leave the child
                        import traceback

                        traceback.print_exc()
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                pids.append(pid)
        return _wait_all(pids, timeout_s)


def _wait_all(pids: list[int], timeout_s: float) -> int:
    """Wait for the ranks; the first failure (or the timeout) stops the others."""
    status = 0
    deadline = time.monotonic() + timeout_s
    live = set(pids)
    while live:
        for pid in list(live):
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                live.discard(pid)
                code = os.waitstatus_to_exitcode(raw)
                if code != 0 and status == 0:
                    status = code if code > 0 else 128 - code
                    _kill(live)
        if live and time.monotonic() > deadline:
            status = status or 124
            _kill(live)
        time.sleep(0.1)
    return status


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def execute(
    runs: Sequence[Run],
    launcher: str,
    scale: Scale,
    sbatch_args: Sequence[str],
    timeout_s: float,
    skip_existing: bool,
) -> dict[str, str]:
    """Perform the runs one after another; returns run id -> error for the failed ones."""
    errors: dict[str, str] = {}
    runner = ForkRunner() if launcher == "fork" else None
    # Multi-node torchrun: this script runs on every node at once, and a node must not delete
    # the file that rank 0 (on the first node) is writing.
    shared_by_nodes = launcher == "torchrun" and int(os.environ.get("NNODES", "1")) > 1
    for i, run in enumerate(runs, 1):
        if skip_existing and _complete(run, scale):
            print(f"[{i}/{len(runs)}] {run.run_id}: complete, skipped", flush=True)
            continue
        run.run_dir.mkdir(parents=True, exist_ok=True)
        if not shared_by_nodes:
            # A stale file from an earlier attempt must not pass for this run's result.
            (run.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        log = run.run_dir / "train.log"
        began = time.monotonic()
        print(f"[{i}/{len(runs)}] {run.run_id} ...", end="", flush=True)
        if runner is not None:
            code = runner.run(run, scale.world_size, log, timeout_s)
        else:
            cmd = launch_command(run, launcher, scale, sbatch_args)
            env = dict(os.environ)
            env.setdefault("PYTHON", sys.executable)
            with log.open("w") as out:
                out.write("$ " + shlex.join(cmd) + "\n")
                out.flush()
                try:
                    code = subprocess.run(
                        cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
                    ).returncode
                except subprocess.TimeoutExpired:
                    code = 124
        took = time.monotonic() - began
        if code != 0:
            errors[run.run_id] = f"exit status {code}; see {log}"
            print(f" FAILED ({took:.0f} s, exit status {code}; log: {log})", flush=True)
        else:
            print(f" ok ({took:.0f} s)", flush=True)
    return errors


# --- collecting ------------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (the run did not start or failed)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(records: Sequence[dict], train_iters: int, warmup: int) -> Result:
    """Median iteration time after ``warmup`` iterations, and the run's peak memory."""
    return summarize_repeats([records], train_iters, warmup)


def summarize_repeats(runs: Sequence[Sequence[dict]], train_iters: int, warmup: int) -> Result:
    """:func:`summarize` over the repeats of one cell: their measured iterations pooled."""
    times: list[float] = []
    tokens: list[float] = []
    peak = 0.0
    for records in runs:
        if len(records) < train_iters:
            raise ValueError(f"only {len(records)} of {train_iters} iterations were logged")
        measured = [r for r in records if r["iteration"] > warmup]
        if not measured:
            raise ValueError(f"no iterations after the {warmup} warm-up iterations")
        times += [float(r["iter_ms"]) for r in measured]
        tokens += [float(r["tokens_per_s"]) for r in measured]
        # The trainer logs the peak so far, so the maximum is the run's peak.
        peak = max(peak, *(float(r["peak_mem_mb"]) for r in records))
    return Result(
        iter_ms_median=statistics.median(times),
        iter_ms_mean=statistics.fmean(times),
        peak_mem_mb=peak,
        tokens_per_s=statistics.median(tokens),
        measured=len(times),
        final_loss=float(runs[0][-1]["loss"]),
    )


def _complete(run: Run, scale: Scale) -> bool:
    try:
        summarize(read_metrics(run.run_dir), scale.train_iters, scale.warmup)
    except (OSError, ValueError):
        return False
    return True


def collect(runs: Sequence[Run], scale: Scale, errors: dict[str, str]) -> list[Row]:
    """Group the runs into table rows (repeats of a cell pooled) and read their results."""
    rows: dict[tuple[int, str, int, int], Row] = {}
    cells: dict[tuple[tuple[int, str, int, int], str], list[Run]] = {}
    for run in runs:
        key = (run.table, run.model, run.batch, run.seq)
        rows.setdefault(key, Row(*key))
        cells.setdefault((key, run.method), []).append(run)
    for (key, method), cell in cells.items():
        row = rows[key]
        row.results[method] = None
        failed = [errors[r.run_id] for r in cell if r.run_id in errors]
        if failed:
            row.errors[method] = failed[0]
            continue
        try:
            records = [read_metrics(r.run_dir) for r in cell]
            row.results[method] = summarize_repeats(records, scale.train_iters, scale.warmup)
        except (OSError, ValueError, KeyError) as exc:
            row.errors[method] = str(exc)
    return list(rows.values())


def speedup(row: Row, baseline: str, method: str = "charm") -> float | None:
    base, ours = row.results.get(baseline), row.results.get(method)
    if base is None or ours is None or ours.iter_ms_median <= 0:
        return None
    return base.iter_ms_median / ours.iter_ms_median


# --- writing ---------------------------------------------------------------------------------

CSV_FIELDS = (
    "table",
    "model",
    "batch_size",
    "seq_length",
    "baseline",
    "baseline_latency_ms",
    "baseline_memory_mb",
    "charm_latency_ms",
    "charm_memory_mb",
    "speedup",
    "measured_iterations",
    "baseline_latency_mean_ms",
    "charm_latency_mean_ms",
    "baseline_tokens_per_s",
    "charm_tokens_per_s",
    "baseline_final_loss",
    "charm_final_loss",
    "error",
)


def write_csv(path: Path, rows: Sequence[Row], baseline: str) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            base, ours = row.results.get(baseline), row.results.get("charm")
            s = speedup(row, baseline)
            writer.writerow(
                {
                    "table": row.table,
                    "model": TABLES[row.table].model_label[row.model],
                    "batch_size": row.batch,
                    "seq_length": row.seq,
                    "baseline": baseline,
                    "baseline_latency_ms": f"{base.iter_ms_median:.1f}" if base else "",
                    "baseline_memory_mb": f"{base.peak_mem_mb:.0f}" if base else "",
                    "charm_latency_ms": f"{ours.iter_ms_median:.1f}" if ours else "",
                    "charm_memory_mb": f"{ours.peak_mem_mb:.0f}" if ours else "",
                    "speedup": f"{s:.2f}" if s is not None else "",
                    "measured_iterations": min(
                        (r.measured for r in (base, ours) if r is not None), default=0
                    ),
                    "baseline_latency_mean_ms": f"{base.iter_ms_mean:.1f}" if base else "",
                    "charm_latency_mean_ms": f"{ours.iter_ms_mean:.1f}" if ours else "",
                    "baseline_tokens_per_s": f"{base.tokens_per_s:.0f}" if base else "",
                    "charm_tokens_per_s": f"{ours.tokens_per_s:.0f}" if ours else "",
                    # Same model, data and seed: the two methods must train the same losses.
                    "baseline_final_loss": f"{base.final_loss:.6f}" if base else "",
                    "charm_final_loss": f"{ours.final_loss:.6f}" if ours else "",
                    "error": "; ".join(f"{m}: {e}" for m, e in row.errors.items()),
                }
            )


def _ms(r: Result | None) -> str:
    return f"{r.iter_ms_median:.1f}" if r else "failed"


def _mb(r: Result | None) -> str:
    return f"{r.peak_mem_mb:,.0f}" if r else "failed"


def markdown_table(number: int, rows: Sequence[Row], baseline: str, label: str) -> str:
    """The table in the paper's layout; CHARM+ latency and the speedup in bold, as there."""
    spec = TABLES[number]
    base_title = METHOD_TITLES.get(baseline, baseline)
    if spec.with_memory:
        head = [
            f"| Batch Size | Seq Len | Model | {base_title} Latency (ms) | {base_title} Memory "
            "(MB) | CHARM+ Latency (ms) | CHARM+ Memory (MB) | Speedup |",
            "|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
    else:
        head = [
            f"| Batch Size | Seq Len | Model | {base_title} {label} (ms) | CHARM+ {label} (ms) "
            f"| Speedup {label} |",
            "|---:|---:|---|---:|---:|---:|",
        ]
    lines = list(head)
    for row in rows:
        base, ours = row.results.get(baseline), row.results.get("charm")
        s = speedup(row, baseline)
        cells = [f"{row.batch:,}", f"{row.seq:,}", spec.model_label[row.model], _ms(base)]
        if spec.with_memory:
            cells.append(_mb(base))
        cells.append(f"**{_ms(ours)}**" if ours else _ms(ours))
        if spec.with_memory:
            cells.append(_mb(ours))
        cells.append(f"**{s:.2f}×**" if s is not None else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_document(
    number: int,
    rows: Sequence[Row],
    baseline: str,
    label: str,
    scale: Scale,
    command: str,
    machine: str,
    code: str = "",
) -> str:
    spec = TABLES[number]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    size = (
        f"sequence lengths divided by {scale.seq_divisor}, tiny stand-in models"
        if scale.seq_divisor > 1
        else "the paper's sizes"
    )
    parts = [
        f"# Table {number} ({scale.name} scale): {spec.title}\n",
        f"- Date: {now}",
        f"- Command: `{command}`",
        f"- Machine: {machine}",
        f"- Code: {code}",
        f"- Ranks: {scale.world_size} ({scale.nodes}{' emulated' if scale.name == 'cpu' else ''}"
        f" node(s) x {scale.ranks_per_node}), "
        f"CP = {scale.world_size}, DP = 1; {size}",
        f"- Runs: {scale.repeats} per cell and method"
        + (", interleaved (ring, CHARM+, ring, CHARM+, ...)" if scale.repeats > 1 else "")
        + f", {scale.train_iters} iterations each",
        f"- Latency: median iteration time over iterations {scale.warmup + 1}-"
        f"{scale.train_iters} of every run (the first {scale.warmup} are warm-up); memory: peak "
        "of rank 0 as the trainer logs it (GPU: max allocated; CPU: max resident set)",
        f"- Baseline: `{baseline}`; speedup = baseline latency / CHARM+ latency\n",
        markdown_table(number, rows, baseline, label),
    ]
    failed = [(row, m, e) for row in rows for m, e in row.errors.items()]
    if failed:
        parts.append("Failed runs:\n")
        for row, method, err in failed:
            parts.append(f"- {row.model} {row.batch}x{row.seq} {method}: {err}")
        parts.append("")
    return "\n".join(parts)


def describe_code() -> str:
    """The git commit the runs used, and whether the work tree had local changes."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return f"commit {sha}" + (" with local changes to tracked files" if dirty else "")


def describe_machine(scale: Scale) -> str:
    if scale.name == "cpu":
        return (
            f"{os.cpu_count()} CPU cores, {scale.world_size} gloo ranks on loopback, fp32 "
            "(no real inter-node link)"
        )
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} GPUs, NCCL, bf16"
    except ImportError:
        pass
    return "GPUs, NCCL, bf16"


# --- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
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
        choices=("fork", "local", "torchrun", "slurm"),
        default=None,
        help="fork (cpu default): ranks forked from this process, which imports the trainer "
        "once; local: one `python -m megatron_charm.train` per run, which starts its own ranks; "
        "torchrun: scripts/launch/torchrun_train.sh per run on this node; slurm (gpu default): "
        "`sbatch --wait scripts/launch/slurm_train.sbatch` per run",
    )
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scale = make_scale(args)
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
        print(
            "#   "
            + shlex.join(["python", "scripts/tables/e2e_tables.py", *again, "--collect-only"])
        )
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
        errors = execute(runs, launcher, scale, args.sbatch_arg, timeout, args.skip_existing)
    rows = collect(runs, scale, errors)

    results_dir = args.results_dir or out
    results_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "scripts/tables/e2e_tables.py", *(argv or sys.argv[1:])])
    machine = describe_machine(scale)
    if launcher in ("fork", "local") and not args.collect_only:
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
