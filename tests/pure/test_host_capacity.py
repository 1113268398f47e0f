"""scripts/bench/host_capacity.py: its processes do their work and report back."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_bench_script


def test_an_unknown_work_is_refused() -> None:
    mod = load_bench_script("host_capacity")
    with pytest.raises(ValueError, match="kind='gemm'"):
        mod._work("gemm")


def test_the_makespan_waits_for_every_process() -> None:
    mod = load_bench_script("host_capacity")
    few = mod.makespan("ops", 1, 20)
    assert few > 0
    # twenty times the calls in each of two processes: far longer than one process's few, and
    # 16,000 small torch operations take more than a millisecond on any host
    many = mod.makespan("ops", 2, 400)
    assert many > 5 * few
    assert many > 1e-3
