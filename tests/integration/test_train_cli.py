"""``megatron-charm-train`` end to end: the default tiny GPT on 4 self-started CPU ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: float = 1200) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "megatron_charm.train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.heavy  # about 60 s: two launches of 4 ranks (CI: make test-heavy, and the 0.19 tier)
def test_default_config_trains_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    common = ["--run-dir", str(run_dir), "logging.log_interval=5", "model.seq_length=64"]
    first = _run([*common, "--train-iters", "20"])
    assert first.returncode == 0, first.stderr[-4000:]
    assert "starting 4 local ranks" in first.stdout
    assert "iter     20/20 | loss" in first.stdout
    assert first.stdout.count("CHARM+ topology") == 1  # logged once, on rank 0

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 21))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_rank", "peak_mem_mb"):
        assert all(r[key] > 0 for r in records), key
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 1.5, losses  # visibly learning the corpus

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["parallel"]["cp_comm_type"] == "charm"
    assert resolved["train"]["train_iters"] == 20
    assert (run_dir / "checkpoints" / "latest").read_text() == "20"

    # The same command again would replace the run: refused, before any rank starts.
    again = _run([*common, "--train-iters", "20"])
    assert again.returncode == 2 and "--resume" in again.stderr and "--overwrite" in again.stderr
    assert "starting" not in again.stdout

    # Overrides after a flag; more iterations than the schedule was made for.
    second = _run(["--run-dir", str(run_dir), "logging.log_interval=5", "--resume",
                   "model.seq_length=64", "--train-iters", "23"])  # fmt: skip
    assert second.returncode == 0, second.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "resumed from" in second.stdout
    assert [r["iteration"] for r in records] == list(range(1, 24))
    # The saved schedule is kept: the rate stays at min_lr instead of jumping back up.
    assert "keeping it" in second.stdout
    assert all(r["lr"] == pytest.approx(resolved["train"]["min_lr"]) for r in records[20:])


def test_bad_config_is_reported_without_starting_ranks(tmp_path):
    result = _run(["--run-dir", str(tmp_path), "parallel.cp_comm_type=p2q"])
    assert result.returncode == 2
    assert "parallel.cp_comm_type='p2q'" in result.stderr
    assert "starting" not in result.stdout


def test_world_size_rules_are_checked_once_before_launching(tmp_path):
    result = _run(["--run-dir", str(tmp_path), "--nproc", "6"])
    assert result.returncode == 2
    assert result.stderr.count("does not divide the number of ranks 6") == 1, result.stderr
    assert "starting" not in result.stdout


def test_overrides_mix_with_flags_on_the_command_line(tmp_path):
    result = _run(["train.lr=1e-3", "--resume", "model.hidden_size=32", "--print-config"])
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout)
    assert cfg["train"]["lr"] == pytest.approx(1e-3) and cfg["model"]["hidden_size"] == 32
    assert cfg["checkpoint"]["resume"] is True
