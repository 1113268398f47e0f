"""Checkpoints under faults, through the trainer's command.

A rank dies in the middle of a save; resuming from the last good checkpoint then gives the same
losses as the run that crashed had before the crash (it trained those iterations uninterrupted).
Damaged checkpoints of each kind stop a resume with a ValueError that names the file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_charm.launch import KILL_GRACE_S
from megatron_charm.train import checkpoint as ckpt
from tests.faults import trainer
from tests.faults.procs import native_crashes, survivors_after
from tests.faults.train_faulty import CRASH_ENV, MODULE

ITERS = ["--train-iters", "4", "checkpoint.save_interval=2"]
CRASH_AT = 4
"""Rank 0 dies while writing this checkpoint (the last of the run)."""


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> tuple[Path, Path, object]:
    """A run whose rank 0 died saving iteration 4; the run dir, an untouched copy, the result."""
    root = tmp_path_factory.mktemp("crash")
    run_dir = root / "run"
    args = ["--run-dir", str(run_dir), *trainer.TINY, *ITERS]
    result = trainer.run(MODULE, args, **{CRASH_ENV: f"0:{CRASH_AT}"})
    left = survivors_after(str(run_dir), 2 * KILL_GRACE_S)
    assert not left, f"ranks {left} outlived the crashed run"
    copy = root / "as-crashed"
    shutil.copytree(run_dir, copy)
    return run_dir, copy, result


def test_a_rank_killed_while_saving_ends_the_run_and_keeps_latest(crashed):
    run_dir, _, result = crashed
    assert result.returncode == 128 + 9, result.stderr[-3000:]
    assert "rank 0 was killed by SIGKILL; the other ranks were stopped" in result.stderr
    assert not native_crashes(result.stderr), result.stderr[-3000:]
    root = run_dir / "checkpoints"
    # The iteration being written is half there, under a temporary name; latest did not move.
    partial = [p.name for p in ckpt.iteration_dir(root, CRASH_AT).iterdir()]
    assert f".{ckpt.MODEL_FILE}.tmp" in " ".join(partial) and ckpt.MODEL_FILE not in partial
    assert ckpt.latest_iteration(root) == 2 and ckpt.complete_iterations(root) == [2]
    assert [r["iteration"] for r in _metrics(run_dir)] == [1, 2, 3, 4]


def test_resume_after_the_crash_repeats_the_uninterrupted_losses(crashed):
    run_dir, _, crash = crashed
    before = _metrics(run_dir)  # iterations 1-4 ran without interruption; the save of 4 died
    args = ["--run-dir", str(run_dir), "--resume", *trainer.TINY, *ITERS]
    result = trainer.run("megatron_charm.train", args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints'} at iteration 2" in result.stdout
    after = _metrics(run_dir)
    assert [r["iteration"] for r in after] == [1, 2, 3, 4]
    for old, new in zip(before, after, strict=True):
        for key in ("loss", "lr", "grad_norm"):
            assert new[key] == old[key], (key, old, new)
    assert ckpt.latest_iteration(run_dir / "checkpoints") == CRASH_AT
    ckpt.read_checkpoint(run_dir / "checkpoints", CRASH_AT)  # complete and loadable now


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# kind -> (damage to a copy of the crashed run, the file the message must name, what it says)
DAMAGE = {
    "truncated_model": (
        lambda c: _truncate(ckpt.iteration_dir(c, 2) / ckpt.MODEL_FILE, 1000),
        lambda c: ckpt.iteration_dir(c, 2) / ckpt.MODEL_FILE,
        "is truncated or corrupt",
    ),
    "garbage_latest": (
        lambda c: (c / ckpt.LATEST).write_bytes(b"\x00\xffgarbage"),
        lambda c: c / ckpt.LATEST,
        "not an iteration number",
    ),
    "latest_missing_iteration": (
        lambda c: (c / ckpt.LATEST).write_text("9"),
        lambda c: ckpt.iteration_dir(c, 9),
        "points at iteration 9",
    ),
    "truncated_rng": (
        lambda c: _truncate(ckpt.rng_file(ckpt.iteration_dir(c, 2), 0), 100),
        lambda c: ckpt.rng_file(ckpt.iteration_dir(c, 2), 0),
        "RNG state file",
    ),
}


@pytest.fixture(scope="module")
def damaged(crashed, tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """Resume a damaged copy of the crashed run for each kind of damage: status, stderr, root."""
    _, copy, _ = crashed
    root = tmp_path_factory.mktemp("damaged")
    run_dirs = {}
    for kind, (damage, _, _) in DAMAGE.items():
        run_dirs[kind] = root / kind
        shutil.copytree(copy, run_dirs[kind])
        damage(run_dirs[kind] / "checkpoints")
    # One rank, one process for all four resumes (megatron-core is imported once).
    single = [
        *("--nproc", "1", "parallel.context_parallel_size=1", "parallel.ranks_per_node=1"),
        *trainer.TINY[4:],
        *ITERS,
    ]
    out = root / "results.json"
    args = [str(out), *map(str, run_dirs.values()), "--", *single]
    result = trainer.run("tests.faults.resume_corrupt", args)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(out.read_text())
    return {kind: (*got[str(d)], d / "checkpoints") for kind, d in run_dirs.items()}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_checkpoint_stops_the_resume_with_a_value_error_naming_the_file(damaged, kind):
    status, stderr, root = damaged[kind]
    _, named, says = DAMAGE[kind]
    assert status == 2, stderr
    assert stderr.startswith("megatron-charm-train: error"), stderr
    assert str(named(root)) in stderr and says in stderr, stderr
    assert "--overwrite" in stderr and "Traceback" not in stderr, stderr
    # Iteration 2 is the only complete one: offered back only when it is not the damaged one.
    offered = "write one of the complete iterations (2)" in stderr
    assert offered == (kind in ("garbage_latest", "latest_missing_iteration")), stderr
