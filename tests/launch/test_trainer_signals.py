"""``megatron-charm-train`` with self-started ranks: SIGTERM or SIGHUP to it leaves no rank behind
(Slurm's ``scancel`` and time limit send SIGTERM; closing the terminal sends SIGHUP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch.test_procs import BOUND_S, REPO, _alive, _assert_gone

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scans /proc"),
]


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent:
            found.append(int(entry))
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_to_trainer_stops_every_rank(tmp_path, sig):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable, "-m", "megatron_charm.train", "--run-dir", str(run_dir), "--nproc", "2",
        "--train-iters", "100000", "parallel.context_parallel_size=2",
        "parallel.ranks_per_node=1", "model.seq_length=64", "logging.log_interval=1",
    ]  # fmt: skip
    launcher = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    metrics = Path(run_dir) / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert launcher.poll() is None, launcher.stderr.read()[-4000:]
            assert time.monotonic() < deadline, "the ranks did not start training in 240 s"
            time.sleep(0.2)
        ranks = _children(launcher.pid)
        assert len(ranks) == 2 and all(map(_alive, ranks)), ranks
        launcher.send_signal(sig)
        assert launcher.wait(timeout=BOUND_S) == -sig
    finally:
        launcher.kill()
        launcher.wait()
    _assert_gone(ranks)
    written = metrics.read_text()
    time.sleep(1.0)
    assert metrics.read_text() == written, "ranks kept training after the launcher was stopped"
