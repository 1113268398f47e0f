"""Rendering: the tables as CSV and as markdown laid out like the paper's."""

from __future__ import annotations

import csv
import datetime
import os
from collections.abc import Sequence
from pathlib import Path

from megatron_charm.bench.provenance import git
from megatron_charm.bench.tables.collect import Result, Row, speedup
from megatron_charm.bench.tables.plan import TABLES, Scale

METHOD_TITLES = {"ring": "Ring", "charm": "CHARM+", "p2p": "Ring (TE p2p)"}

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
    sha = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    if sha is None or dirty is None:
        return "unknown (not a git checkout)"
    return f"commit {sha}" + (" with local changes to tracked files" if dirty else "")


def describe_machine(scale: Scale, cross_link: str | None = None) -> str:
    """The machine in words; ``cross_link`` describes an emulated link between nodes."""
    if scale.name == "cpu":
        link = cross_link or "loopback, no real inter-node link"
        return f"{os.cpu_count()} CPU cores, {scale.world_size} gloo ranks, fp32 ({link})"
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} GPUs, NCCL, bf16"
    except ImportError:
        pass
    return "GPUs, NCCL, bf16"
