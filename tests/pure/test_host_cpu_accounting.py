"""scripts/bench/host_cpu_accounting.py: the CPU a run spent against the CPU its replay
charges."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.bench_scripts import load_bench_script
from tests.sim.test_testbed_profile import PROFILE
from tests.sim.testbed_results import bench_result

# the testbed's profile of those tests, with its host shared by two slots
CPU_PROFILE = replace(PROFILE, compute={**PROFILE.compute, "shared_slots": 2.0})


def _row(layout: str, ranks: int, measured: float, cpu: float, work: float, error: float):
    return {
        "point": f"{layout}-point",
        "method": "charm",
        "pass": "fwd",
        "layout": layout,
        "ranks": ranks,
        "cores": 2.0,
        "measured_s": measured,
        "cpu_s": cpu,
        "host_work_s": work,
        "error": error,
    }


def test_the_unexplained_cpu_is_per_rank_and_second() -> None:
    mod = load_bench_script("host_cpu_accounting")
    # eight ranks that each spent 0.02 cores beyond the charged work, over passes of 1 and 3 s
    rows = [_row("2x4", 8, t, 1.5 * t + 0.02 * 8 * t, 1.5 * t, -0.1) for t in (1.0, 3.0)]
    assert mod.unexplained_per_rank_second(rows) == pytest.approx(0.02)
    assert mod.unexplained_per_rank_second([_row("2x2", 4, 1.0, 1.0, 1.0, 0.0)]) == 0.0


def test_busy_and_idle_hosts_are_told_apart() -> None:
    mod = load_bench_script("host_cpu_accounting")
    rows = [
        _row("2x4", 8, 1.0, 1.9, 1.7, -0.10),  # 95% busy
        _row("2x4", 8, 1.0, 1.8, 1.7, -0.06),  # 90% busy
        _row("2x4", 8, 1.0, 0.6, 0.6, +0.02),  # 30% busy
        _row("2x2", 4, 1.0, 1.0, 0.9, +0.01),
    ]
    by = {s["layout"]: s for s in mod.summary(rows)}
    assert list(by) == ["2x4", "2x2"]
    s = by["2x4"]
    assert (s["rows"], s["busy_rows"]) == (3, 2)
    assert s["busy"] == pytest.approx(0.9)
    assert s["busy_error"] == pytest.approx(-0.08)
    assert s["other_error"] == pytest.approx(0.02)
    assert s["charged"] == pytest.approx(1.7 / 1.8)
    assert by["2x2"]["busy_error"] is None
    text = mod.markdown(rows, "cmd")
    assert "| 2x4 | 3 | 0.90 | 0.94 |" in text
    assert "| 2x4-point | charm | fwd | 1900.0 | 1700.0 | 0.89 | 0.95 | -10.0% |" in text


def test_rows_carry_the_replays_work_and_the_measured_cpu(tmp_path) -> None:
    mod = load_bench_script("host_cpu_accounting")
    result = bench_result({"ring": 300.0, "charm": 200.0})
    for m in result["methods"].values():
        m["fwd"]["cpu_s"], m["fwdbwd"]["cpu_s"] = 0.2, 0.7
    path = tmp_path / "2x2-shared-causal-b1-s1024-h4-100mbit.json"
    path.write_text(json.dumps(result))
    prof = tmp_path / "profile.json"
    CPU_PROFILE.save(prof)
    rows = mod.rows_of([str(path)], str(prof), "100mbit")
    assert {r["point"] for r in rows} == {path.stem}
    assert {(r["method"], r["pass"]) for r in rows} == {
        (m, p) for m in ("ring", "charm") for p in ("fwd", "fwdbwd")
    }
    for r in rows:
        assert r["cpu_s"] == (0.2 if r["pass"] == "fwd" else 0.7)
        assert r["layout"] == "2x2" and r["ranks"] == 4 and r["cores"] == 2.0
        assert r["host_work_s"] > 0
    fwd = {r["method"]: r["host_work_s"] for r in rows if r["pass"] == "fwd"}
    both = {r["method"]: r["host_work_s"] for r in rows if r["pass"] == "fwdbwd"}
    assert all(both[m] > fwd[m] for m in fwd)  # the backward's work is added


def test_a_profile_without_a_shared_host_is_refused(tmp_path) -> None:
    mod = load_bench_script("host_cpu_accounting")
    gpu = replace(CPU_PROFILE, compute={"kind": "flops", "tflops": 100.0})
    prof = tmp_path / "profile.json"
    gpu.save(prof)
    with pytest.raises(ValueError, match="shared_slots 0"):
        mod.rows_of([], str(prof), None)
    assert mod.rows_of([], str(prof), None, cores=2.0) == []  # the host's cores given
