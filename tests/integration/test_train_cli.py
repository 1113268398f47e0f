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


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
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

    second = _run([*common, "--train-iters", "23", "--resume"])
    assert second.returncode == 0, second.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "resumed from" in second.stdout
    assert [r["iteration"] for r in records] == list(range(1, 24))


def test_bad_config_is_reported_without_starting_ranks(tmp_path):
    result = _run(["--run-dir", str(tmp_path), "parallel.cp_comm_type=p2q"])
    assert result.returncode == 2
    assert "parallel.cp_comm_type='p2q'" in result.stderr
    assert "starting" not in result.stdout
