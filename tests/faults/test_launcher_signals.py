"""``megatron-charm-train`` (the project's launcher with two training ranks) killed by a signal.

SIGINT is Ctrl-C, SIGTERM Slurm's ``scancel`` or time limit, SIGHUP a closed terminal: the
launcher stops its ranks and then ends as the signal says. SIGKILL cannot be handled: the ranks die
of the parent-death signal the launcher set on them, since nothing else would stop them (each runs
in its own session). Either way no process of the job survives, found by the run directory in
their command lines. SIGTERM and SIGKILL come while the ranks train (then the metrics file must
stop growing); SIGINT and SIGHUP as soon as both ranks exist, which is cheaper and covers a
signal during start-up.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_charm.launch import KILL_GRACE_S
from tests.faults import trainer
from tests.faults.procs import (
    alive,
    children,
    default_signals,
    processes_with,
    survivors_after,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="scans /proc; parent-death signal is Linux-only"
)
BOUND_S = 2 * KILL_GRACE_S
"""The launcher gives its ranks KILL_GRACE_S between SIGTERM and SIGKILL."""


def _wait_for(condition, launcher: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + trainer.SUBPROCESS_LIMIT_S
    while not condition():
        assert launcher.poll() is None, launcher.stderr.read()[-4000:]
        assert time.monotonic() < deadline, f"the ranks did not {what}"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("sig", "status", "training"),
    [
        (signal.SIGINT, 130, False),  # KeyboardInterrupt, which the command turns into 130
        (signal.SIGTERM, -signal.SIGTERM, True),  # dies of the signal, as without the launcher
        (signal.SIGHUP, -signal.SIGHUP, False),
        (signal.SIGKILL, -signal.SIGKILL, True),
    ],
    ids=["SIGINT-starting", "SIGTERM-training", "SIGHUP-starting", "SIGKILL-training"],
)
def test_signal_to_the_trainer_leaves_no_process_of_the_job(tmp_path, sig, status, training):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_charm.train", "--run-dir", str(run_dir)]
    cmd += [*trainer.TINY, "--train-iters", "100000"]
    launcher = subprocess.Popen(
        cmd,
        preexec_fn=default_signals,
        env=trainer.environ(),
        cwd=trainer.REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = Path(run_dir) / "metrics.jsonl"
    try:
        # both ranks exist and show the run directory in their command lines: a rank caught
        # between fork and exec can show an empty one for a moment
        def started() -> bool:
            ranks = children(launcher.pid)
            return len(ranks) == 2 and set(ranks) <= set(processes_with(str(run_dir)))

        _wait_for(started, launcher, "start")
        if training:
            lines = lambda: metrics.exists() and metrics.read_text().count("\n") >= 2  # noqa: E731
            _wait_for(lines, launcher, "start training")
        ranks = children(launcher.pid)
        assert len(ranks) == 2 and all(map(alive, ranks)), ranks
        # the second rank may still be in exec, its command line empty for a moment
        shown = lambda: set(ranks) <= set(processes_with(str(run_dir)))  # noqa: E731
        _wait_for(shown, launcher, "show the run directory")
        launcher.send_signal(sig)
        assert launcher.wait(timeout=BOUND_S) == status
    finally:
        launcher.kill()
        launcher.wait()
    left = survivors_after(str(run_dir), BOUND_S)
    assert not left, f"processes {left} of the job outlived the launcher by {BOUND_S} s"
    if training:
        written = metrics.read_text()
        time.sleep(0.5)
        assert metrics.read_text() == written, "ranks kept training after the launcher stopped"
