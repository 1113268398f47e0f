"""scripts/bench/agreement_cost.py: its table and its argument errors."""

from __future__ import annotations

import re

import pytest

from tests.bench_scripts import load_bench_script


def test_the_table_gives_median_and_largest_over_the_ranks_in_ms() -> None:
    mod = load_bench_script("agreement_cost")
    ranks = [[0.001, 0.004], [0.005, 0.010], [0.0015, 0.006]]  # per rank: all_reduce, all_gather
    table = mod.markdown([("3x1", ranks)], iters=5, cross_rate="100mbit")
    row = next(line for line in table.splitlines() if line.startswith("| 3x1"))
    assert row == "| 3x1 | 3 | 1.50 / 5.00 | 6.00 / 10.00 |", row
    assert "of 5 calls" in table and "100mbit" in table


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--layouts", "2x"], "NODESxRANKS_PER_NODE"),
        (["--layouts", "2x0"], "NODESxRANKS_PER_NODE"),
        (["--layouts", "1x16"], "NODES in [2, 16]"),
        (["--layouts", "2x2", "--iters", "0"], "--iters 0"),
    ],
)
def test_bad_arguments_name_the_setting(argv: list[str], words: str) -> None:
    mod = load_bench_script("agreement_cost")
    with pytest.raises(ValueError, match=re.escape(words)):
        mod.main(argv)
