"""scripts/bench/winner_map.py: one cell of the map and its table, on a small topology."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_bench_script


def _module():
    return load_bench_script("winner_map")


def test_cell_picks_the_fastest_runnable_method_and_the_table_marks_charm():
    wm = _module()
    slow = wm.cell("H100", 2, 2, 1, 1.0, 2)  # 2 heads: a2a (CP 4) cannot split them
    fast = wm.cell("H100", 2, 2, 1, 400.0, 4)
    for c in (slow, fast):
        times = c["times_ms"]
        assert c["winner"] == min(times, key=times.get)
        assert c["charm_over_best"] == pytest.approx(times["charm"] / times[c["winner"]])
        assert c["charm_over_best"] >= 1.0
    assert "a2a" not in slow["times_ms"] and "a2a" in fast["times_ms"]
    # comparison methods are not a user's choice: never on the map
    assert not {"ring-contig", "tasp", "a2a+charm"} & set(fast["times_ms"])
    assert fast["ccr"] > slow["ccr"]  # more cross bandwidth, less communication time
    table = wm.markdown("t", [slow, fast])
    assert "| 4 |" in table and "| 2 |" in table
    for c in (slow, fast):
        if c["winner"] == "charm":
            assert "**charm**" in table
        else:
            assert f"(charm {c['charm_over_best']:.2f}x)" in table
