"""scripts/bench/plot.py's table of the fastest method per point of a sweep."""

from __future__ import annotations

import json

from tests.bench_scripts import load_bench_script


def _point(name: str, fwd: dict[str, float], fwdbwd: dict[str, float]) -> dict:
    methods = {m: {"fwd": {"median": fwd[m]}, "fwdbwd": {"median": fwdbwd[m]}} for m in fwd}
    return {"_name": name, "methods": methods}


def test_winners_name_the_fastest_and_count_charm_within_five_percent() -> None:
    plot = load_bench_script("plot")
    rows = [
        # charm fastest in both passes
        _point(
            "a", {"charm": 1.0, "ring": 2.0, "a2a": 1.5}, {"charm": 3.0, "ring": 6.0, "a2a": 4.0}
        ),
        # a2a fastest; charm 4% behind forward+backward, 20% forward
        _point(
            "b", {"charm": 1.2, "ring": 2.0, "a2a": 1.0}, {"charm": 5.2, "ring": 9.0, "a2a": 5.0}
        ),
    ]
    text = plot.winners(rows)
    assert "forward: charm fastest at 1, within 5% of the fastest at 1" in text
    assert "forward+backward: charm fastest at 1, within 5% of the fastest at 2" in text
    assert "| a | charm | 1.00 | charm | 1.00 |" in text
    assert "| b | a2a | 1.20 | a2a | 1.04 |" in text


def test_the_script_writes_them_without_a_figure(tmp_path) -> None:
    plot = load_bench_script("plot")
    folder = tmp_path / "sweep"
    folder.mkdir()
    res = _point("p", {"charm": 1.0, "ring": 2.0}, {"charm": 3.0, "ring": 6.0})
    del res["_name"]
    for m in res["methods"].values():
        for mode in ("fwd", "fwdbwd"):
            m[mode]["bound_ratio"] = 1.5
    res["ccr"] = {"fwd": 0.1, "fwdbwd": 0.2}
    (folder / "p.json").write_text(json.dumps(res))
    out = tmp_path / "table.md"
    plot.main([str(folder), "--winners", "--no-png", "--md", str(out)])
    text = out.read_text()
    assert "| p | 0.10 | 0.20 |" in text and "| p | charm | 1.00 | charm | 1.00 |" in text
    assert not (tmp_path / "sweep.png").exists()
