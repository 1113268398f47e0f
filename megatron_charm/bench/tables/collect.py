"""Collecting results: each run's ``metrics.jsonl`` reduced to table cells."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_charm.bench.tables.plan import Run, Scale


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


def is_complete(run: Run, scale: Scale) -> bool:
    """Whether ``run`` logged every iteration already (``--skip-existing``)."""
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
