"""scripts/bench/repeat_fits.py: each run of a repeated calibration, the median run and the pool,
scored on a sweep."""

from __future__ import annotations

import copy
from pathlib import Path

from megatron_charm.sim.calibrate import combine_runs
from tests.bench_scripts import load_bench_script
from tests.sim.test_profile import _raw

SWEEP = Path(__file__).resolve().parents[2] / "docs" / "results" / "sweep-epyc-20261206-11"


def _raws() -> dict:
    runs = []
    for slow in (1.0, 1.4, 1.1):
        raw = _raw()
        for k in raw["kernel"]:
            k["fwd_s"] *= slow
            k["bwd_s"] *= slow
        runs.append(raw)
    return dict(copy.deepcopy(runs[0]), repeats=runs[1:], date="2026-12-06 04:36 UTC")


def test_each_run_alone_then_the_median_run_and_the_pool():
    fits = load_bench_script("repeat_fits")
    raw = _raws()
    got = fits.variants(raw)
    assert [label for label, _, _ in got] == ["run 1", "run 2", "run 3", "median run", "pooled"]
    # a run alone carries the raw file's labels, not the other runs
    alone = got[1][1]
    assert "repeats" not in alone and alone["date"] == raw["date"]
    assert alone["kernel"] == raw["repeats"][0]["kernel"]
    # one run, no repeats: just itself
    assert [v[0] for v in fits.variants(copy.deepcopy(raw["repeats"][0]))] == ["run 1"]


def test_score_counts_every_time_and_the_slower_fit_predicts_longer():
    fits = load_bench_script("repeat_fits")
    from megatron_charm.sim.testbed import group_runs

    groups = group_runs([str(SWEEP / "2x2-shared-causal-b1-s512-h4-200mbit.json")])
    variants = fits.variants(_raws())
    fast = fits.score(combine_runs(variants[0][1], "pool", "nvlink")[0], groups, "100mbit")
    slow = fits.score(combine_runs(variants[1][1], "pool", "nvlink")[0], groups, "100mbit")
    from megatron_charm.plan import METHODS

    methods = sum(m in METHODS for m in groups[0][1][0][1]["methods"])  # the ones it replays
    assert fast["times"] == slow["times"] == 2 * methods  # forward and forward+backward
    assert set(fast["layouts"]) == {"2x2"}
    assert 0 <= fast["within"] <= fast["times"]
    # blocks 40% slower: every prediction at least as long, so the median error grows
    assert slow["median"] > fast["median"]


def test_slowest_rank_rebuilds_the_old_block_timings():
    fits = load_bench_script("repeat_fits")
    raw = _raws()
    for run in (raw, *raw["repeats"]):
        for k in run["kernel"]:
            k["fwd_ranks_s"] = [k["fwd_s"], 2 * k["fwd_s"], k["fwd_s"]]
    old = fits.slowest_rank(raw)
    assert [k["fwd_s"] for k in old["kernel"]] == [2 * k["fwd_s"] for k in raw["kernel"]]
    assert old["repeats"][1]["kernel"][0]["fwd_s"] == 2 * raw["repeats"][1]["kernel"][0]["fwd_s"]
    # the backward had no ranks' timings: unchanged; the raw itself untouched
    assert [k["bwd_s"] for k in old["kernel"]] == [k["bwd_s"] for k in raw["kernel"]]
    assert raw["kernel"][0]["fwd_s"] < old["kernel"][0]["fwd_s"]
