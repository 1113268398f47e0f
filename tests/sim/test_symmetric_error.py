"""scripts/bench/symmetric_error.py, which measures the known errors that ``SYMMETRIC_ERROR``
holds (Note [Node symmetry])."""

from __future__ import annotations

from megatron_charm.sim.programs import SYMMETRIC_ERROR
from tests.bench_scripts import load_bench_script


def test_the_measure_on_a_small_group_stays_within_the_quoted_errors(monkeypatch) -> None:
    bench = load_bench_script("symmetric_error")
    # one group of the default list: 4 x 2 on one NIC per GPU
    first = next(bench.cases())
    monkeypatch.setattr(bench, "cases", lambda: iter([first]))
    worst = bench.errors()
    methods = {method for _, method, _ in worst}
    assert methods == set(bench.METHODS)
    for (_, method, backward), (err, where) in worst.items():
        assert where.startswith("4 x 2"), where
        # ring and a2a+p2p move whole tokens: exact; the others within what ranges quote
        assert abs(err) <= SYMMETRIC_ERROR.get(method, 1e-9), (method, backward, err)
    # the large groups are the ones auto replays for one node, and 16 x 8 below them
    sizes = [(t.num_nodes, t.ranks_per_node) for _, t, _, _ in bench.large_cases()]
    assert sizes == [(16, 8), (32, 8), (64, 8)]
    assert set(bench.LARGE_METHODS) <= set(SYMMETRIC_ERROR)
