"""The GPU path of Tables 6 and 7 on patched Megatron-LM, run dry on CPU.

The logs here are written by the test in the line format of Megatron-LM ``core_v0.16.1``'s
``training_log`` and ``report_memory`` (format samples with made-up numbers, not results).
"""

from __future__ import annotations

import importlib.util
import shlex
import statistics
from pathlib import Path

import pytest

from megatron_charm.megatron.tables import (
    Cell,
    Cluster,
    parse_training_log,
    plan_cells,
    pretrain_gpt_args,
    table_rows,
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tables" / "megatron_tables.py"


def _script():
    spec = importlib.util.spec_from_file_location("megatron_tables_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _megatron_log(times_ms: list[float], tflops: list[float], batch: int, peaks: dict) -> str:
    """A log in Megatron-LM's format: one training_log line per iteration, memory reports."""
    lines = []
    n = len(times_ms)
    for i, (ms, tput) in enumerate(zip(times_ms, tflops, strict=True), start=1):
        lines.append(
            f" [2026-12-01 00:00:{i:02d}.000000] iteration {i:8d}/{n:8d} | consumed samples: "
            f"{i * batch:12d} | elapsed time per iteration (ms): {ms:.1f} | throughput per GPU "
            f"(TFLOP/s/GPU): {tput:.1f} | learning rate: 3.000000E-04 | global batch size: "
            f"{batch:5d} | lm loss: 1.000000E+01 | loss scale: 1.0 | grad norm: 1.000 | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |"
        )
        for rank, by_iteration in peaks.items():
            if i in by_iteration:
                lines.append(
                    f"[Rank {rank}] (after {i} iterations) memory (MB) | allocated: 1.00 | max "
                    f"allocated: {by_iteration[i]:.2f} | reserved: 2.00 | max reserved: 2.00"
                )
    return "\n".join(lines) + "\n"


def test_arms_differ_only_in_the_cp_comm_type():
    cluster = Cluster()
    charm = pretrain_gpt_args(Cell(6, "GPT-1.3B", 4, 8192, "charm"), cluster)
    ring = pretrain_gpt_args(Cell(6, "GPT-1.3B", 4, 8192, "p2p"), cluster)
    i = charm.index("--cp-comm-type")
    assert charm[i + 1] == "charm" and ring[i + 1] == "p2p"
    assert charm[:i] == ring[:i]
    assert charm[i + 2 :] == [*ring[i + 2 :], "--charm-ranks-per-node", "8"]
    assert charm[charm.index("--transformer-impl") + 1] == "transformer_engine"
    assert charm[charm.index("--context-parallel-size") + 1] == "16"


def test_plan_covers_the_papers_points():
    cells = plan_cells([6, 7], ["p2p", "a2a+p2p"])
    assert len(cells) == (2 * 4 + 4) * 3
    assert {(c.batch, c.seq) for c in cells if c.table == 7} == {
        (16, 16384), (32, 8192), (64, 4096), (128, 2048)
    }  # fmt: skip
    a2a = pretrain_gpt_args(Cell(7, "GPT-350M", 16, 16384, "a2a+p2p"), Cluster())
    assert " ".join(a2a).endswith("--hierarchical-context-parallel-sizes 8 2")
    with pytest.raises(ValueError, match="tables are 6 and 7"):
        plan_cells([5])


def test_dry_run_prints_sbatch_and_pretrain_gpt_lines(capsys, tmp_path):
    status = _script().main(
        ["--table", "7", "--dry-run", "--megatron-lm", "/opt/Megatron-LM", "--logs", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert status == 0 and not list(tmp_path.iterdir())
    sbatch = [shlex.split(line) for line in out.splitlines() if line.startswith("sbatch")]
    nodes = [line for line in out.splitlines() if "each node runs" in line]
    assert len(sbatch) == len(nodes) == 8
    for words in sbatch:
        assert "--cpus-per-task=64" in words and "--gpus-per-node=8" in words
        assert any("CUDA_DEVICE_MAX_CONNECTIONS=1" in w for w in words)
        assert "scripts/tables/megatron_run.sbatch" in words
    assert all("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun" in line for line in nodes)
    assert all("/opt/Megatron-LM/pretrain_gpt.py" in line for line in nodes)


def test_cpu_request_can_be_overridden(capsys, tmp_path):
    _script().main(["--table", "7", "--dry-run", "--cpus-per-node", "96", "--logs", str(tmp_path)])
    assert "--cpus-per-task=96" in capsys.readouterr().out


def test_training_log_is_read_like_megatron_reports_it():
    times = [5000.0, 900.0, 880.0, 870.0, 860.0, 850.0, 840.0, 860.0, 845.0, 855.0]
    tflops = [10.0, 50.0, 51.0, 52.0, 53.0, 54.0, 55.0, 53.0, 54.0, 54.5]
    peaks = {0: {1: 1000.0, 10: 1500.0}, 3: {1: 1200.0, 10: 1400.0}}
    summary = parse_training_log(_megatron_log(times, tflops, 16, peaks), 16384, warmup=5)
    assert summary.iterations == 5
    assert summary.iter_ms == statistics.median(times[5:])
    assert summary.tflops_per_gpu == statistics.median(tflops[5:])
    assert summary.tokens_per_s == pytest.approx(16 * 16384 / (summary.iter_ms / 1000))
    assert summary.peak_mem_mb == 1500.0  # the largest last report over ranks
    with pytest.raises(ValueError, match="after the 5 warm-up"):
        parse_training_log(_megatron_log(times[:5], tflops[:5], 16, {}), 16384, warmup=5)


def test_collect_builds_the_table_from_logs(tmp_path, capsys):
    # Per point (batch) the ring run takes ring_ms and the CHARM+ run 0.8 of it: speedup 1.25.
    ring_ms = {16: 1000.0, 32: 1100.0, 64: 1200.0, 128: 1300.0}
    charm_ms = {16: 800.0, 32: 880.0, 64: 960.0, 128: 1040.0}
    cells = plan_cells([7])
    for n, cell in enumerate(cells):
        ms = (charm_ms if cell.method == "charm" else ring_ms)[cell.batch]
        log = _megatron_log([ms] * 8, [40.0] * 8, cell.batch, {0: {8: 2000.0 + n}})
        (tmp_path / f"{cell.run_id}.log").write_text(log)
    assert _script().main(["--table", "7", "--collect-only", "--logs", str(tmp_path)]) == 0
    table = (tmp_path / "table7-megatron-p2p.md").read_text()
    assert table.count("| GPT-350M |") == 4
    assert table.count("| 1.25x |") == 4
    assert "| 16 | 16,384 | GPT-350M | 1,000.0 | 2,000 | 800.0 | 2,001 | 1.25x |" in table
    summaries = {
        c: parse_training_log((tmp_path / f"{c.run_id}.log").read_text(), c.seq) for c in cells
    }
    rows = table_rows(summaries)
    assert sorted(row["batch"] for row in rows) == [16, 32, 64, 128]
    for row in rows:
        assert row["p2p_ms"] == ring_ms[row["batch"]]
        assert row["charm_ms"] == charm_ms[row["batch"]]
        assert row["speedup"] == pytest.approx(1.25)
