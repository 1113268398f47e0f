"""megatron_charm.sim.testbed: runs of one sweep point compared together (Note [Repeatability])."""

from __future__ import annotations

import json

import pytest

from megatron_charm.sim.testbed import compare, group_runs, main
from tests.sim.testbed_results import bench_result


def _result(ring_ms: float, charm_ms: float | None = None, heads: int = 4) -> dict:
    times = {"ring": ring_ms} if charm_ms is None else {"ring": ring_ms, "charm": charm_ms}
    return bench_result(times, heads)


def test_repeats_are_compared_with_the_median_of_the_runs() -> None:
    one = compare(_result(1000.0), intra_gbps=1.0)
    three = compare(_result(1000.0), intra_gbps=1.0, repeats=[_result(1300.0), _result(700.0)])
    by = {(r["method"], r["pass"]): r for r in three}
    fwd = by[("ring", "fwd")]
    assert fwd["runs_s"] == pytest.approx([1.0, 1.3, 0.7])
    assert fwd["measured_s"] == pytest.approx(1.0)  # the median, not the first run's
    assert fwd["spread"] == pytest.approx(1.3 / 0.7 - 1)
    # the prediction comes from the first run alone: the same with or without repeats
    assert fwd["predicted_s"] == pytest.approx(one[0]["predicted_s"])
    assert one[0]["spread"] == 0.0 and one[0]["runs_s"] == [1.0]
    shifted = compare(_result(1000.0), intra_gbps=1.0, repeats=[_result(1300.0)])
    assert shifted[0]["measured_s"] == pytest.approx(1.15)


def test_a_method_missing_from_a_repeat_uses_the_runs_that_have_it() -> None:
    rows = compare(_result(1000.0, 800.0), intra_gbps=1.0, repeats=[_result(1200.0)])
    charm = next(r for r in rows if r["method"] == "charm" and r["pass"] == "fwd")
    assert charm["runs_s"] == pytest.approx([0.8]) and charm["spread"] == 0.0


def test_a_method_only_a_repeat_ran_is_compared_too() -> None:
    rows = compare(_result(1000.0), intra_gbps=1.0, repeats=[_result(1200.0, 700.0)])
    by = {(r["method"], r["pass"]): r for r in rows}
    assert by[("charm", "fwd")]["runs_s"] == pytest.approx([0.7])
    assert by[("ring", "fwd")]["runs_s"] == pytest.approx([1.0, 1.2])
    assert by[("charm", "fwd")]["predicted_s"] > 0


def test_files_of_one_name_are_runs_of_one_point(tmp_path) -> None:
    for folder, ms in (("a", 1000.0), ("b", 1100.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "p.json").write_text(json.dumps(_result(ms)))
        (tmp_path / folder / "q.json").write_text(json.dumps(_result(ms, heads=8)))
    paths = [str(tmp_path / f / n) for f in ("a", "b") for n in ("p.json", "q.json")]
    groups = group_runs(paths)
    assert [(name, len(runs)) for name, runs in groups] == [("p.json", 2), ("q.json", 2)]
    (tmp_path / "b" / "p.json").write_text(json.dumps(_result(1100.0, heads=8)))
    with pytest.raises(ValueError, match=r"differ in \['heads', 'kv_heads'\].*Repeatability"):
        group_runs(paths)


def test_the_table_lists_every_run_and_the_header_their_spread(tmp_path, capsys) -> None:
    for folder, ms in (("a", 1000.0), ("b", 1250.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "p.json").write_text(json.dumps(_result(ms)))
    (tmp_path / "a" / "q.json").write_text(json.dumps(_result(900.0, heads=8)))
    args = [str(tmp_path / "a" / "p.json"), str(tmp_path / "b" / "p.json")]
    assert main([*args, str(tmp_path / "a" / "q.json"), "--intra-gbps", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 configurations" in out
    assert "3 result files, 1 points run more than once" in out
    assert "differs by 25% in the median and up to 25%" in out
    assert "### p.json (2 runs)" in out and "### q.json\n" in out
    assert "| ring | fwd | 1125 | 1000, 1250 | 25% |" in out
    # a point run once keeps the plain table
    assert "| method | pass | measured ms | predicted ms | error |" in out


def test_the_header_counts_per_cp_size_and_each_methods_median() -> None:
    from megatron_charm.sim.testbed import error_summary

    rows = [
        {"ranks": 4, "method": "ring", "error": 0.1},
        {"ranks": 4, "method": "ring", "error": 0.3},
        {"ranks": 8, "method": "ring", "error": -0.5},
        {"ranks": 8, "method": "charm", "error": -0.05},
    ]
    assert error_summary(rows) == (
        "Within +-20%: 1 of 2 on 4 ranks; 1 of 2 on 8 ranks. "
        "Median error per method: charm -5%, ring +10%."
    )


def test_the_replayed_timeline_lists_every_exchange_and_its_time(tmp_path, capsys) -> None:
    # --timeline prints the replay's forward per rank: its makespan is the one compare()
    # predicts, and every exchange of every rank's program shows as one X line
    from megatron_charm.plan import PlanOptions
    from megatron_charm.plan.types import Layout
    from megatron_charm.sim.programs import programs

    path = tmp_path / "p.json"
    path.write_text(json.dumps(_result(1000.0, 800.0)))
    assert main([str(path), "--intra-gbps", "1", "--timeline", "charm"]) == 0
    out = capsys.readouterr().out
    rows = compare(_result(1000.0, 800.0), intra_gbps=1.0)
    charm = next(r for r in rows if r["method"] == "charm" and r["pass"] == "fwd")
    assert f"charm fwd, replayed: {charm['predicted_s'] * 1e3:.1f} ms" in out
    progs = programs(PlanOptions(method="charm"), Layout(2, 2), True, mode="full")
    per_rank = out.split("cp_rank ")[1:]
    assert len(per_rank) == 4
    for prog, text in zip(progs.forward, per_rank, strict=True):
        assert text.count(" X ") == len(prog.exchanges()) > 0
    with pytest.raises(ValueError, match="--timeline 'a2a': the result has no such method"):
        main([str(path), "--intra-gbps", "1", "--timeline", "a2a"])
