"""megatron_charm.sim.timeline_edges: a pass's edges, measured and replayed (Note [Edges of a
pass])."""

from __future__ import annotations

import json

import pytest

from megatron_charm.sim.engine import RankResult
from megatron_charm.sim.testbed import main
from megatron_charm.sim.timeline_edges import (
    RankEdges,
    format_edges,
    measured_edges,
    replayed_edges,
)
from tests.sim.testbed_results import bench_result

MS = 1e-3


def _call(shift_ms: float, wall_ms: float) -> dict:
    """One traced call: post, block, wait, block, merge; every time ``shift_ms`` later."""

    def t(x: float) -> float:
        return (x + shift_ms) * MS

    return {
        "events": [
            ("fwd", "Exchange", "cross.kv", t(1.0), t(1.1)),
            ("fwd", "Compute", "", t(1.1), t(3.1)),
            ("fwd", "Wait", "cross.kv", t(3.1), t(5.0)),
            ("fwd", "Compute", "", t(5.0), t(6.0)),
            ("fwd", "Merge", "", t(6.0), t(6.5)),
        ],
        "wall": wall_ms * MS,
    }


def _raw(ranks: int, walls_ms: tuple[float, ...] = (9.0, 7.0, 8.0)) -> dict:
    # iteration i of every rank is shifted by i ms; the slowest rank's wall picks the median
    return {
        "ranks": [
            {
                "cp_rank": r,
                "recs": {"charm": {"fwd": [_call(i, w + r * 0.1) for i, w in enumerate(walls_ms)]}},
            }
            for r in reversed(range(ranks))
        ]
    }


def test_measured_edges_of_the_median_call() -> None:
    edges = measured_edges(_raw(2), "charm")
    assert [e.cp_rank for e in edges] == [0, 1]
    e = edges[0]  # the median wall is iteration 2's (8.0 ms): every time 2 ms later
    assert e.first_exchange == pytest.approx(3.0 * MS)
    assert e.first_block == pytest.approx(3.1 * MS)
    assert e.in_blocks == pytest.approx(3.5 * MS)  # both blocks and the merge
    assert e.waiting == pytest.approx(1.9 * MS)
    assert e.last_arrival == pytest.approx(7.0 * MS)
    assert e.end == pytest.approx(8.0 * MS)  # the call's return, not its last instruction
    with pytest.raises(ValueError, match="no run of 'ring' .*it has charm"):
        measured_edges(_raw(2), "ring")


def test_replayed_edges_from_an_engine_record() -> None:
    r = RankResult(3, finish=10 * MS, busy=0.0, exposed=0.0)
    r.timeline = [
        (0.0, 1 * MS, "H"),
        (1 * MS, 3 * MS, "C q3/kv3"),
        (3 * MS, 5 * MS, "W 0"),
        (5 * MS, 6 * MS, "M o3.full"),
        (6 * MS, 7 * MS, "H"),
    ]
    r.transfers = [(1.5 * MS, 4 * MS, "full.kv"), (1.2 * MS, 2 * MS, "cross.q")]
    (e,) = replayed_edges([r])
    assert e == RankEdges(3, 1.2 * MS, 1 * MS, 3 * MS, 2 * MS, 5 * MS, 10 * MS)
    # a rank that never waits or computes
    idle = RankResult(0, finish=1 * MS, busy=0.0, exposed=0.0)
    assert replayed_edges([idle])[0] == RankEdges(0, None, None, 0.0, 0.0, None, 1 * MS)


def test_the_table_pairs_each_rank_and_refuses_another_layout() -> None:
    m = [RankEdges(0, 1 * MS, 2 * MS, 3 * MS, 4 * MS, 5 * MS, 6 * MS)]
    r = [RankEdges(0, None, 2.5 * MS, 3 * MS, 1 * MS, None, 7 * MS)]
    table = format_edges(m, r)
    assert "| 0 | 1.0 / - | 2.0 / 2.5 | 3.0 / 3.0 | 4.0 / 1.0 | 5.0 / - | 6.0 / 7.0 |" in table
    with pytest.raises(ValueError, match=r"ranks \[0\] are not the replay's \[1\]"):
        format_edges(m, [RankEdges(1, None, None, 0.0, 0.0, None, 0.0)])


def test_the_cli_compares_one_points_pass(tmp_path, capsys) -> None:
    point = tmp_path / "p.json"
    point.write_text(json.dumps(bench_result({"ring": 1000.0, "charm": 800.0})))
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(_raw(4)))
    argv = [str(point), "--intra-gbps", "1", "--timeline", "charm", "--measured", str(raw)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "charm fwd: measured 8.3 ms (this call), replayed" in out  # rank 3's 8.0 + 0.3
    rows = [line for line in out.splitlines() if line.startswith("| ") and "/" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| 0", "| 1", "| 2", "| 3"]
    assert rows[0].split(" | ")[1].startswith("3.0 / ")  # rank 0 posts at 3.0 ms measured
    for argv, why in (
        ([str(point), "--measured", str(raw)], "no --timeline"),
        ([str(point), str(point), "--timeline", "charm", "--measured", str(raw)], "2 results"),
    ):
        with pytest.raises(ValueError, match=f"compares one point's pass.*{why}"):
            main([*argv, "--intra-gbps", "1"])
