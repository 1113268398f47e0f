"""``cp_attention`` on real gloo ranks when one rank is killed, stalls or disagrees.

One job (:mod:`tests.faults.attention_ranks`) runs every case side by side, each case in its own
gloo world; the tests below read what each rank saw. The outcome is always a clear error on every
other rank within twice the CP timeout: ``DistributedError`` for a dead or stalled peer,
``ValueError`` for disagreeing options or shapes; never a hang, never a native crash.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.attention_ranks import CASES, PHASES, STALL_TIMEOUTS, STARTUP_S, STEPS
from tests.faults.procs import native_crashes

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 4.0
"""The CP topology's timeout in every case (``CPTopology.build(timeout=...)``)."""
BOUND_S = 2 * TIMEOUT_S
PASSES = [f"{p}{s}" for s in range(STEPS) for p in ("forward", "backward")]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("attention-faults")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    limit = STARTUP_S + (STALL_TIMEOUTS + 8) * TIMEOUT_S + 60
    cmd = [sys.executable, "-m", "tests.faults.attention_ranks", str(out), str(TIMEOUT_S)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _ranks(job: Path, name: str) -> tuple[list[dict], dict[int, int | None], dict[int, str]]:
    """Each rank's record, exit status and log for case ``name``."""
    exits = {int(r): code for r, code in json.loads((job / "exits.json").read_text())[name].items()}
    hung = [r for r, code in exits.items() if code is None]
    assert not hung, f"{name}: ranks {hung} hung and were killed"
    logs = {r: (job / name / f"rank{r}.log").read_text() for r in exits}
    for r, text in logs.items():
        assert not native_crashes(text), f"{name}: rank {r} crashed natively:\n{text[-3000:]}"
    records = []
    for r in sorted(exits):
        path = job / name / f"rank{r}.json"
        records.append(json.loads(path.read_text()) if path.exists() else None)
    return records, exits, logs


def _pass_of(phase: str) -> int:
    """Index in :data:`PASSES` of the first pass the faulty rank no longer completes."""
    return {
        "before_forward": 0,
        "during_forward": 0,
        "after_forward": 1,
        "during_backward": 1,
        "after_backward": 2,
    }[phase]


def _assert_clear_error(name: str, record: dict, error_type: str, first_pass: int) -> None:
    """``record`` ended in ``error_type`` in pass ``first_pass`` or the one after (a rank that
    does not exchange with the faulty one in that pass meets it in the next), within BOUND_S."""
    assert record["error"] is not None, f"{name}: cp_rank {record['cp_rank']} saw no error"
    kind, where, seconds, message = record["error"]
    assert kind == error_type, f"{name}: cp_rank {record['cp_rank']}: {kind}: {message}"
    assert where in PASSES[first_pass : first_pass + 2], (name, record)
    assert record["passes"] == PASSES[: PASSES.index(where)], (name, record)
    assert seconds < BOUND_S, f"{name}: cp_rank {record['cp_rank']} needed {seconds:.1f} s"


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_killed_rank_gives_every_other_rank_a_distributed_error(job, sig, phase):
    name = f"kill-{sig}-{phase}"
    records, exits, _ = _ranks(job, name)
    faulty = CASES[name].cp_size - 1
    assert exits[faulty] == -getattr(signal, sig), exits
    for record in records[:faulty]:
        assert exits[record["cp_rank"]] == 0, exits
        _assert_clear_error(name, record, "DistributedError", _pass_of(phase))
        assert "A peer rank died" in record["error"][3]


@pytest.mark.parametrize("phase", ["before_forward", "during_forward"])
def test_stalled_rank_times_out_the_others_and_then_fails_itself(job, phase):
    name = f"stall-{phase}"
    records, exits, _ = _ranks(job, name)
    assert all(code == 0 for code in exits.values()), exits
    waiting, stalled = records
    _assert_clear_error(name, waiting, "DistributedError", 0)
    kind, where, seconds, message = waiting["error"]
    # It waited for the timeout, not for the stalled rank, and says so.
    assert "Timed out" in message and seconds >= 0.5 * TIMEOUT_S, waiting["error"]
    # The stalled rank wakes up to find its peer gone: a clear error too, not a hang.
    assert stalled["error"] is not None and stalled["error"][0] == "DistributedError", stalled
    assert stalled["error"][1] in PASSES[:2], stalled


@pytest.mark.parametrize(
    ("case", "first_pass", "names"),
    [
        ("mismatch-options", 0, "cross_return='fp32'"),
        ("mismatch-shape", 2, "local_shape_sbhd=(12, 1, 4, 8) vs (8, 1, 4, 8)"),
    ],
)
def test_disagreeing_rank_gives_every_rank_a_value_error(job, case, first_pass, names):
    records, exits, _ = _ranks(job, case)
    assert all(code == 0 for code in exits.values()), exits
    for record in records:
        _assert_clear_error(case, record, "ValueError", first_pass)
        assert record["error"][1] == PASSES[first_pass] and names in record["error"][3]
