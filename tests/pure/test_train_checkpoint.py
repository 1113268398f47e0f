"""Checkpoint files without ranks: safe loading, corrupt files, atomic writes, the run directory,
the learning-rate schedule kept on resume, and the metrics file of a resumed run."""

from __future__ import annotations

import json
import random

import numpy
import pytest
import torch

from megatron_charm.train import checkpoint as ckpt
from megatron_charm.train.config import load_config
from megatron_charm.train.metrics import MetricsWriter
from megatron_charm.train.rundir import check_run_dir
from megatron_charm.train.schedule import learning_rate, resolved_schedule, schedule_on_resume


def _state() -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _write(root, iteration: int, rank: int = 0) -> None:
    directory = ckpt.iteration_dir(root, iteration)
    ckpt.write_state(directory, _state(), {"iteration": iteration, "schedule": {}})
    ckpt.write_rng(directory, rank)
    ckpt.commit_latest(root, iteration)


class _PlantMarker:
    """Unpickling this creates ``path``: what a hostile checkpoint could do instead."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_round_trip_restores_state_and_every_generator(tmp_path):
    _write(tmp_path, 3)
    torch.manual_seed(7)
    numpy.random.seed(7)
    random.seed(7)
    ckpt.write_rng(ckpt.iteration_dir(tmp_path, 3), 0)
    want = (torch.rand(3), numpy.random.rand(3), random.random())
    torch.manual_seed(0)
    numpy.random.seed(0)
    random.seed(0)
    assert ckpt.latest_iteration(tmp_path) == 3
    state, meta = ckpt.read_checkpoint(tmp_path, 3)
    assert meta["iteration"] == 3 and set(state) == {"model", "optimizer"}
    assert ckpt.restore_rng(tmp_path, 3, 0)
    got = (torch.rand(3), numpy.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and numpy.array_equal(got[1], want[1])
    assert got[2] == want[2]
    assert not ckpt.restore_rng(tmp_path, 3, 5)  # no file for a rank that was not there


@pytest.mark.parametrize("which", ["model", "rng"])
def test_a_malicious_pickle_is_refused_and_runs_nothing(tmp_path, which):
    _write(tmp_path, 2)
    directory = ckpt.iteration_dir(tmp_path, 2)
    target = directory / ckpt.MODEL_FILE if which == "model" else ckpt.rng_file(directory, 0)
    marker = tmp_path / "pwned"
    torch.save({"model": _PlantMarker(marker)}, target)
    # The planted file really does run code when unpickled without restrictions ...
    torch.load(target, weights_only=False)
    assert marker.exists()
    marker.unlink()
    # ... and the checkpoint loader refuses it without running it.
    with pytest.raises(ValueError) as info:
        if which == "model":
            ckpt.read_checkpoint(tmp_path, 2)
        else:
            ckpt.restore_rng(tmp_path, 2, 0)
    assert str(target) in str(info.value) and "never unpickled" in str(info.value)
    assert not marker.exists()


def test_truncated_model_file_names_the_file_and_the_way_out(tmp_path):
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    path = ckpt.iteration_dir(tmp_path, 4) / ckpt.MODEL_FILE
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError) as info:
        ckpt.read_checkpoint(tmp_path, 4)
    message = str(info.value)
    assert str(path) in message and "truncated" in message
    # The damaged iteration 4 is not offered as the way out.
    assert "complete iterations (2)" in message and "--overwrite" in message


def test_truncated_rng_file_names_the_file(tmp_path):
    _write(tmp_path, 2)
    path = ckpt.rng_file(ckpt.iteration_dir(tmp_path, 2), 0)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match="RNG state file .*rng_00000.pt"):
        ckpt.restore_rng(tmp_path, 2, 0)


def test_garbage_latest_names_the_marker(tmp_path):
    _write(tmp_path, 2)
    (tmp_path / ckpt.LATEST).write_bytes(b"\x00\xffgarbage")
    with pytest.raises(ValueError) as info:
        ckpt.latest_iteration(tmp_path)
    assert str(tmp_path / ckpt.LATEST) in str(info.value)
    assert "not an iteration number" in str(info.value) and "(2)" in str(info.value)


def test_latest_pointing_at_a_missing_iteration(tmp_path):
    _write(tmp_path, 2)
    (tmp_path / ckpt.LATEST).write_text("9")
    with pytest.raises(ValueError) as info:
        ckpt.read_checkpoint(tmp_path, ckpt.latest_iteration(tmp_path))
    assert "points at iteration 9" in str(info.value)
    assert str(ckpt.iteration_dir(tmp_path, 9)) in str(info.value)


def test_corrupt_metadata_names_the_file(tmp_path):
    _write(tmp_path, 2)
    meta = ckpt.iteration_dir(tmp_path, 2) / ckpt.META_FILE
    meta.write_text('{"iteration": 2,')
    with pytest.raises(ValueError, match=f"checkpoint metadata {meta} is corrupt"):
        ckpt.read_checkpoint(tmp_path, 2)


def test_a_crash_while_saving_leaves_latest_at_the_last_complete_checkpoint(tmp_path, monkeypatch):
    _write(tmp_path, 2)
    before = (ckpt.iteration_dir(tmp_path, 2) / ckpt.MODEL_FILE).read_bytes()

    def crash_midway(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        ckpt.write_state(ckpt.iteration_dir(tmp_path, 4), _state(), {"iteration": 4})
    # The partial file never took the real name, and no temporary file is left behind.
    assert list(ckpt.iteration_dir(tmp_path, 4).iterdir()) == []
    assert ckpt.latest_iteration(tmp_path) == 2
    assert ckpt.complete_iterations(tmp_path) == [2]
    monkeypatch.undo()
    # Overwriting an existing checkpoint that crashes keeps the old file intact.
    monkeypatch.setattr(ckpt.torch, "save", crash_midway)
    with pytest.raises(OSError):
        ckpt.write_state(ckpt.iteration_dir(tmp_path, 2), _state(), {"iteration": 2})
    assert (ckpt.iteration_dir(tmp_path, 2) / ckpt.MODEL_FILE).read_bytes() == before


def test_a_fresh_run_refuses_an_existing_run_directory(tmp_path):
    run = tmp_path / "run"
    fresh = load_config(None, [f"run.dir={str(run)!r}"])
    assert check_run_dir(fresh) is None  # nothing there yet
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 1}\n')
    with pytest.raises(ValueError) as info:
        check_run_dir(fresh)
    assert "--resume" in str(info.value) and "--overwrite" in str(info.value)
    assert str(run / "metrics.jsonl") in str(info.value)
    overwrite = load_config(None, [f"run.dir={str(run)!r}", "run.overwrite=true"])
    assert check_run_dir(overwrite) is None


def test_checkpoints_alone_also_count_as_an_earlier_run(tmp_path):
    run = tmp_path / "run"
    _write(run / "checkpoints", 5)
    with pytest.raises(ValueError, match="checkpoints in"):
        check_run_dir(load_config(None, [f"run.dir={str(run)!r}"]))
    resume = load_config(None, [f"run.dir={str(run)!r}", "checkpoint.resume=true"])
    assert check_run_dir(resume) == 5


def test_resume_with_more_iterations_keeps_the_saved_schedule():
    short = load_config(None, ["train.train_iters=20", "train.lr_warmup_iters=2"]).train
    saved = resolved_schedule(short)
    assert saved == {"lr_warmup_iters": 2, "lr_decay_iters": 20}
    longer = load_config(None, ["train.train_iters=30", "train.lr_warmup_iters=2"]).train
    kept = schedule_on_resume(longer, saved)
    assert kept.lr_decay_iters == 20 and kept.train_iters == 30
    # No jump at the resume step: the rate continues the saved curve, then stays at min_lr.
    assert learning_rate(kept, 20) == pytest.approx(short.min_lr)
    assert learning_rate(kept, 20) <= learning_rate(short, 19)
    assert learning_rate(longer, 20) > 2 * learning_rate(short, 19)  # what re-stretching did
    # An explicit decay length in the config wins.
    explicit = load_config(None, ["train.train_iters=30", "train.lr_decay_iters=30"]).train
    assert schedule_on_resume(explicit, saved) is explicit


def test_metrics_of_a_resumed_run_drop_iterations_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in range(1, 8)) + '{"it')
    writer = MetricsWriter(path, resumed_at=5)
    writer.write({"iteration": 6})
    writer.close()
    lines = [json.loads(x)["iteration"] for x in path.read_text().splitlines()]
    assert lines == [1, 2, 3, 4, 5, 6]
    MetricsWriter(path).close()  # a fresh run starts the file over
    assert path.read_text() == ""
