"""Note [Repeated calibrations]: the runs of ``calibrate --repeat`` pooled into one sample set."""

from __future__ import annotations

import copy
import statistics
from dataclasses import replace

import pytest

from megatron_charm.sim.calibrate import combine_runs
from megatron_charm.sim.profile import fit_profile
from megatron_charm.sim.repeats import (
    DRIFT_WARN,
    REPEAT_WARN,
    pick_repeat,
    pool_runs,
    repeat_summary,
    speed_drift,
    split_runs,
)
from tests.sim.test_profile import _raw


def _run(slow: float, link: float = 1.0) -> dict:
    raw = _raw()
    for k in raw["kernel"]:
        k["fwd_s"] *= slow
        k["bwd_s"] *= slow
    for cls in ("intra", "cross"):
        for x in raw["p2p"][cls]:
            x["s"] *= link
    raw["kernel_under_traffic"] = {
        "tokens": 2048,
        "messages": int(100 * slow),
        "fwd_s": 1.2 * slow,
        "bwd_s": 1.1 * slow,
        "fwd_alone_s": slow,
        "bwd_alone_s": slow,
    }
    raw["blocks_in_passes"] = [
        {
            "method": "ring",
            "s_local": 512,
            "backward": False,
            "cpu_s": (slow + 2.0) / 2,
            "rounds": [slow, 2.0],
        }
    ]
    return raw


def test_every_timing_is_the_median_of_the_runs() -> None:
    runs = [_run(1.0), _run(1.3, link=0.9), _run(1.1, link=1.2)]
    pooled = pool_runs(copy.deepcopy(runs))
    for i, k in enumerate(pooled["kernel"]):
        # each block size its own median: the three runs' middle one
        assert k["fwd_s"] == statistics.median(r["kernel"][i]["fwd_s"] for r in runs)
        assert k["fwd_s"] == runs[2]["kernel"][i]["fwd_s"]
        assert k["tokens"] == runs[0]["kernel"][i]["tokens"]
    # the links' median comes from another run than the blocks'
    assert pooled["p2p"]["cross"][-1]["s"] == runs[0]["p2p"]["cross"][-1]["s"]
    assert pooled["concurrent_cross"] == runs[0]["concurrent_cross"]
    # a count the runs chose: their median one; names and sizes their own
    assert pooled["kernel_under_traffic"]["messages"] == 110
    assert pooled["device"] == "cpu" and pooled["nodes"] == 2
    # the rounds of a pass sample all count, and its cpu_s is their median
    sample = pooled["blocks_in_passes"][0]
    assert sample["rounds"] == [1.0, 2.0, 1.3, 2.0, 1.1, 2.0]
    assert sample["cpu_s"] == pytest.approx(1.65)
    # one run pools to itself
    assert pool_runs([copy.deepcopy(runs[1])]) == pool_runs([runs[1]]) == runs[1]


def test_runs_that_measured_different_things_do_not_pool() -> None:
    other = _run(1.0)
    other["kernel"][0]["tokens"] = 128
    with pytest.raises(ValueError, match=r"different kernel\[0\].tokens"):
        pool_runs([_run(1.0), other])
    short = _run(1.0)
    short["kernel"].pop()
    with pytest.raises(ValueError, match="number of kernel samples"):
        pool_runs([_run(1.0), short])
    extra = _run(1.0)
    extra["host_cores"] = 2
    with pytest.raises(ValueError, match="fields of the samples"):
        pool_runs([_run(1.0), extra])
    with pytest.raises(ValueError, match="no calibration runs"):
        pool_runs([])


def test_combine_fits_the_pooled_samples_and_states_the_runs_spread() -> None:
    runs = [_run(1.0), _run(1.3), _run(1.1)]
    raw = dict(copy.deepcopy(runs[0]), repeats=copy.deepcopy(runs[1:]), date="D", host={"x": 1})
    profile, samples = combine_runs(raw, "pool", "nvlink")
    assert samples["kernel"] == runs[2]["kernel"]  # blocks 10% slow: the median run's
    want = fit_profile(pool_runs(copy.deepcopy(runs)))
    assert profile.compute == want.compute
    assert profile.provenance["combine"] == "pool"
    summary = profile.provenance["repeats"]
    assert len(summary) == 3 and all("kept" not in row for row in summary)
    # the spread: the 30%-slow run's own fit against the pooled one, about 0.3 / 1.1 on the
    # blocks' share of a prediction
    slow_fwd = summary[1]["predicted_s"]["ring fwd"] / summary[2]["predicted_s"]["ring fwd"]
    assert slow_fwd > 1.05
    assert profile.fit_error["repeat"] >= slow_fwd - 1.0 - 1e-9
    # the median run, as before 2026-12-06: the run itself, marked kept
    median_run, kept = combine_runs(raw, "median-run", "nvlink")
    assert kept["kernel"] == runs[2]["kernel"]
    assert [row["kept"] for row in median_run.provenance["repeats"]] == [False, False, True]
    # one run: fitted as it is, no spread
    single, _ = combine_runs(copy.deepcopy(runs[0]), "pool", "nvlink")
    assert "repeat" not in single.fit_error
    with pytest.raises(ValueError, match="--combine 'mean'"):
        combine_runs(raw, "mean", "nvlink")


def test_split_runs_gives_each_run_the_files_labels_or_none() -> None:
    runs = [_run(1.0), _run(1.3)]
    raw = dict(copy.deepcopy(runs[0]), repeats=copy.deepcopy(runs[1:]), date="D", host={"x": 1})
    labelled = split_runs(raw)
    # each run as measured, with the file's labels (what --from-raw --run N reads)
    assert [r["kernel"] for r in labelled] == [r["kernel"] for r in runs]
    assert all(r["date"] == "D" and r["host"] == {"x": 1} for r in labelled)
    assert all("repeats" not in r for r in labelled)
    # samples alone (what the fit pools): nothing that labels the file
    bare = split_runs(raw, labels=False)
    assert bare == runs


def _again(raw: dict, fwd: float, bwd: float) -> dict:
    """``raw`` with its largest block timed again at the end, ``fwd`` / ``bwd`` times the first."""
    first = max(raw["kernel"], key=lambda k: (k["tokens"], k["heads"]))
    again = {"tokens": first["tokens"], "heads": first["heads"]}
    again.update(fwd_s=first["fwd_s"] * fwd, bwd_s=first["bwd_s"] * bwd)
    return {**raw, "kernel_again": again}


def test_drift_is_how_far_the_largest_block_moved_within_the_run() -> None:
    # Note [A calibration's drift]: the larger of forward and backward, slower or faster alike
    assert speed_drift(_run(1.0)) is None  # samples from before the second timing
    assert speed_drift(_again(_run(1.0), 1.0, 1.0)) == pytest.approx(0.0)
    assert speed_drift(_again(_run(1.0), 1.15, 1.05)) == pytest.approx(0.15)
    assert speed_drift(_again(_run(1.0), 1.0, 1 / 1.25)) == pytest.approx(0.25)
    # it joins the profile's fit errors, and so its known error
    prof = fit_profile(_again(_run(1.0), 1.3, 1.0))
    assert prof.fit_error["drift"] == pytest.approx(0.3)
    assert prof.known_error >= 0.3
    assert "drift" not in fit_profile(_run(1.0)).fit_error
    # a second timing of a block the run never timed: the samples are broken
    broken = _again(_run(1.0), 1.0, 1.0)
    broken["kernel_again"]["tokens"] = 3
    with pytest.raises(ValueError, match="3 tokens"):
        speed_drift(broken)
    # pooled runs keep it, as the median of the runs' second timings
    runs = [_again(_run(1.0), f, 1.0) for f in (1.0, 1.3, 1.1)]
    assert speed_drift(pool_runs(copy.deepcopy(runs))) == pytest.approx(0.1)
    # a calibration of several runs moved as much as its least steady run, kept or pooled: here
    # the run that moved 30% is neither the median run nor what the pool's timings give (18%)
    runs = [_again(_run(1.0), 1.3, 1.0), _again(_run(1.3), 1.0, 1.0), _again(_run(1.1), 1.0, 1.0)]
    raw = dict(copy.deepcopy(runs[0]), repeats=copy.deepcopy(runs[1:]))
    assert speed_drift(runs[pick_repeat(runs)]) == 0.0
    assert speed_drift(pool_runs(copy.deepcopy(runs))) == pytest.approx(1.3 / 1.1 - 1.0)
    for how in ("median-run", "pool"):
        profile, _ = combine_runs(raw, how, "nvlink")
        assert profile.fit_error["drift"] == pytest.approx(0.3)
        rows = profile.provenance["repeats"]
        assert [r["drift"] for r in rows] == pytest.approx([0.3, 0.0, 0.0])


def test_calibrate_warns_of_a_drifting_machine() -> None:
    from megatron_charm.sim.calibrate import describe

    moved = describe(fit_profile(_again(_run(1.0), 1.0 + DRIFT_WARN, 1.0)))
    assert "warning: the largest block's time moved by 10%" in moved
    assert "calibrate again when it is quiet" in moved
    still = describe(fit_profile(_again(_run(1.0), 1.0 + DRIFT_WARN / 2, 1.0)))
    assert "warning" not in still and "drift 5%" in still
    # and of runs whose own profiles disagree (Note [Repeated calibrations])
    steady = fit_profile(_run(1.0))
    apart = replace(steady, fit_error={**steady.fit_error, "repeat": REPEAT_WARN})
    assert "warning: the runs' own profiles predict up to 10% apart" in describe(apart)
    close = replace(steady, fit_error={**steady.fit_error, "repeat": REPEAT_WARN / 2})
    assert "warning" not in describe(close)


def test_ranks_taking_turns_on_one_host_count_their_median() -> None:
    # each rank's turn is one more timing of the same block on the same cores: the median; ranks
    # on devices of their own ran at once, and the slowest gates the pass
    from megatron_charm.sim.calibrate_worker import typical_time

    turns = [0.10, 0.13, 0.10, 0.11]
    assert typical_time(turns, one_host=True) == pytest.approx(0.105)
    assert typical_time(turns, one_host=False) == 0.13
    assert typical_time([0.2], one_host=True) == 0.2


def test_pick_repeat_keeps_the_median_run_and_measures_the_spread() -> None:
    # three runs, one disturbed (blocks 30% slow): the middle one is kept
    assert pick_repeat([_run(1.0), _run(1.3), _run(1.1)]) == 2
    # of two, the faster: a disturbance only slows a run (links do not decide)
    assert pick_repeat([_run(1.25), _run(1.0, link=1.5)]) == 1
    assert pick_repeat([_run(1.0)]) == 0
    summary = repeat_summary([_run(1.25), _run(1.0)], 1)
    assert [s["kept"] for s in summary] == [False, True]
    assert set(summary[0]) == {"kept", "block_fwd_s", "block_bwd_s", "intra_s", "cross_s"}
    # pooled runs keep none of them
    assert all("kept" not in s for s in repeat_summary([_run(1.25), _run(1.0)], None))
    with pytest.raises(ValueError, match="no calibration runs"):
        pick_repeat([])


def test_from_raw_refuses_runs_that_measured_different_things(tmp_path, capsys) -> None:
    import json

    from megatron_charm.sim.cli import main

    other = _run(1.0)
    other["kernel"][0]["tokens"] = 128
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(dict(_run(1.0), repeats=[other])))
    argv = ["calibrate", "--from-raw", str(path), "--combine", "pool", "--out", "x.json"]
    assert main(argv) == 2
    assert "calibration runs measured different kernel[0].tokens" in capsys.readouterr().err
