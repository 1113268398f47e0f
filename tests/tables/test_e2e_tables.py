"""The end-to-end table pipeline (megatron_charm.bench.tables): plan, run, collect, write."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_charm.bench.tables.collect import Result, Row, summarize, summarize_repeats
from megatron_charm.bench.tables.render import markdown_table, write_csv

REPO = Path(__file__).resolve().parents[2]
MODULE = "megatron_charm.bench.tables"
SHIM = REPO / "scripts" / "tables" / "e2e_tables.py"


def _run_script(
    *args: str, timeout: float = 120, shim: bool = False
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    command = [str(SHIM)] if shim else ["-m", MODULE]
    return subprocess.run(
        [sys.executable, *command, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _records(times: list[float], mem: list[float]) -> list[dict]:
    return [
        {"iteration": i + 1, "iter_ms": t, "peak_mem_mb": m, "tokens_per_s": 1000.0, "loss": 5.0}
        for i, (t, m) in enumerate(zip(times, mem, strict=True))
    ]


def test_summarize_drops_warmup_and_takes_the_median():
    result = summarize(_records([900, 500, 30, 20, 10], [1, 2, 3, 5, 4]), 5, warmup=2)
    assert result.iter_ms_median == 20  # iterations 3-5 only
    assert result.measured == 3
    assert result.peak_mem_mb == 5
    with pytest.raises(ValueError, match="only 3 of 5 iterations"):
        summarize(_records([1, 2, 3], [1, 1, 1]), 5, warmup=1)
    # Repeats of a cell: the measured iterations of every run pooled, the highest peak.
    pooled = summarize_repeats(
        [_records([900, 30, 10], [1, 1, 7]), _records([800, 50, 40], [2, 2, 2])], 3, warmup=1
    )
    assert (pooled.iter_ms_median, pooled.measured, pooled.peak_mem_mb) == (35, 4, 7)


def test_markdown_and_csv_layout(tmp_path):
    def result(ms: float, mb: float) -> object:
        return Result(ms, ms, mb, 1.0, 3, 5.0)

    row6 = Row(6, "gpt-1.3b", 16, 2048, {"ring": result(200.0, 10), "charm": result(80.0, 11)})
    md6 = markdown_table(6, [row6], "ring", "cpu")
    assert md6.splitlines()[0] == (
        "| Batch Size | Seq Len | Model | Ring Latency (ms) | Ring Memory (MB) | CHARM+ Latency "
        "(ms) | CHARM+ Memory (MB) | Speedup |"
    )
    assert (
        md6.splitlines()[2] == "| 16 | 2,048 | GPT-1.3B | 200.0 | 10 | **80.0** | 11 | **2.50×** |"
    )

    row7 = Row(7, "gpt-350m", 128, 2048, {"ring": result(150.0, 1), "charm": None})
    row7.errors["charm"] = "exit status 1"
    md7 = markdown_table(7, [row7], "ring", "H100")
    assert md7.splitlines()[0] == (
        "| Batch Size | Seq Len | Model | Ring H100 (ms) | CHARM+ H100 (ms) | Speedup H100 |"
    )
    assert md7.splitlines()[2] == "| 128 | 2,048 | GPT3-350M | 150.0 | failed | n/a |"

    path = tmp_path / "t.csv"
    write_csv(path, [row6], "ring")
    (line,) = csv.DictReader(path.open())
    assert line["speedup"] == "2.50"
    assert line["baseline_latency_ms"] == "200.0" and line["charm_memory_mb"] == "11"


def test_gpu_plan_matches_the_paper():
    """--scale gpu: the paper's 24 runs on 16 GPUs (2 x 8), CP = 16, at the paper's sizes."""
    out = _run_script("--scale", "gpu", "--dry-run", "--out", "/shared/tables")
    assert out.returncode == 0, out.stderr
    commands = [line for line in out.stdout.splitlines() if line.startswith("sbatch")]
    assert len(commands) == 2 * (8 + 4)
    for cmd in commands:
        assert "--wait" in cmd and "--nodes=2" in cmd and "--gpus-per-node=8" in cmd
        assert "parallel.context_parallel_size=16" in cmd and "data.kind=mock" in cmd
    assert sum("configs/gpt-1.3b.yaml" in c for c in commands) == 8
    table7 = [c for c in commands if "table7-" in c]
    shapes = {
        (
            c.split("train.global_batch_size=")[1].split()[0],
            c.split("model.seq_length=")[1].split()[0],
        )
        for c in table7
    }
    assert shapes == {("16", "16384"), ("32", "8192"), ("64", "4096"), ("128", "2048")}
    assert "--collect-only" in out.stdout
    assert f"python -m {MODULE} --scale gpu" in out.stdout
    # Every run starts its directory over: a re-run must not be refused as a clobber.
    assert all("run.overwrite=true" in c for c in commands)
    # The old script path is a shim for the same command.
    shim = _run_script("--scale", "gpu", "--dry-run", "--out", "/shared/tables", shim=True)
    assert shim.returncode == 0, shim.stderr
    assert shim.stdout == out.stdout


@pytest.mark.e2e
@pytest.mark.heavy  # about 25 s (CI: make test-heavy)
def test_cpu_pipeline_end_to_end(tmp_path):
    """One row of each table at --scale cpu, 3 iterations: real runs, real tables."""
    out = _run_script(
        "--scale", "cpu", "--model", "gpt-350m", "--shape", "16x2048", "--shape", "128x2048",
        "--train-iters", "3", "--warmup", "1", "--repeats", "1", "--out", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "4 runs, 0 failed" in out.stdout

    for number, (batch, seq) in ((6, (16, 128)), (7, (128, 128))):
        (row,) = list(csv.DictReader((tmp_path / f"table{number}-cpu.csv").open()))
        assert (row["batch_size"], row["seq_length"]) == (str(batch), str(seq))
        ring, charm = float(row["baseline_latency_ms"]), float(row["charm_latency_ms"])
        assert ring > 0 and charm > 0
        # The speedup column is ring / CHARM+ latency (both rounded to 0.1 ms in the CSV).
        assert float(row["speedup"]) == pytest.approx(ring / charm, abs=0.01)
        assert float(row["baseline_memory_mb"]) > 50 and float(row["charm_memory_mb"]) > 50
        assert row["measured_iterations"] == "2" and row["error"] == ""
        # Same weights, data and seed: ring and CHARM+ train the same losses.
        assert float(row["charm_final_loss"]) == pytest.approx(
            float(row["baseline_final_loss"]), rel=1e-4
        )

        md = (tmp_path / f"table{number}-cpu.md").read_text()
        assert f"| {batch} | {seq} | " in md
        assert f"**{float(row['speedup']):.2f}×**" in md

        # Each cell is one trainer run with its own metrics.jsonl and resolved config.
        for method in ("ring", "charm"):
            run = tmp_path / "runs" / f"table{number}-gpt-350m-b{batch}-s{seq}-{method}"
            lines = (run / "metrics.jsonl").read_text().splitlines()
            assert [json.loads(x)["iteration"] for x in lines] == [1, 2, 3]
            config = (run / "config.yaml").read_text()
            assert f"cp_comm_type: {method}" in config and "context_parallel_size: 4" in config


def test_testbed_launcher_runs_the_trainer_as_the_testbeds_ranks(tmp_path):
    """``--launcher testbed``: the trainer command runs as every rank of the testbed; rank 0's
    output becomes the run's log, and a failing rank fails the run."""
    from types import SimpleNamespace

    from megatron_charm.bench.tables.plan import SCALES, plan_runs
    from megatron_charm.bench.tables.runner import execute, launch_command

    scale = SCALES["cpu"]
    runs = plan_runs(
        (6,), scale, ["ring", "charm"], tmp_path, models=["gpt-350m"], shapes=[(2, 16384)]
    )
    runs = [r for r in runs if r.run_id.endswith("-r1")]
    cmd = launch_command(runs[0], "testbed", scale, [])
    assert cmd[:3] == [sys.executable, "-m", "megatron_charm.train"]

    class FakeTestbed:
        def __init__(self, fail: str) -> None:
            self.fail, self.calls = fail, []

        def run(self, cmd, *, timeout_s, env, log_dir):
            self.calls.append(cmd)
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / "rank0.out").write_text("iteration 1 of 16\n")
            code = 1 if self.fail in " ".join(cmd) else 0
            ranks = [SimpleNamespace(returncode=code if r == 3 else 0) for r in range(4)]
            return SimpleNamespace(timed_out=False, ranks=ranks)

    tb = FakeTestbed(fail="cp_comm_type=charm")
    errors = execute(runs, "testbed", scale, [], 60.0, False, tb)
    assert len(tb.calls) == 2 and list(errors) == [runs[1].run_id]
    log = (runs[0].run_dir / "train.log").read_text()
    assert log.startswith("$ ") and "iteration 1 of 16" in log


@pytest.mark.parametrize("flag", ["--nodes", "--ranks-per-node", "--train-iters", "--repeats"])
def test_a_count_of_zero_is_refused_not_taken_for_the_scales_default(flag, capsys):
    from megatron_charm.bench.tables.cli import main

    assert main(["--scale", "cpu", "--dry-run", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} 0 must be >= 1" in err and "leave it out for the cpu scale's" in err
