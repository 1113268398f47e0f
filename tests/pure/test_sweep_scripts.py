"""The peers sweep's method filter and table (scripts/bench/sweep.py, peers_table.py)."""

from __future__ import annotations

from tests.bench_scripts import load_bench_script as _load


def test_peers_keep_only_the_methods_whose_split_divides():
    sweep = _load("sweep")
    two_by_two = ("2x2", "shared", True, 1, 516, 4, "100mbit")  # 516 = 6 x 86: tasp fits
    assert sweep.fitting(two_by_two, sweep.PEERS) == sweep.PEERS
    two_by_four = ("2x4", "rails", True, 2, 512, 4, "100mbit")
    kept = sweep.fitting(two_by_four, sweep.PEERS)
    # 4 heads over 8 ranks (a2a), 512 tokens into 2 x 7 chunks (tasp), batch 2 (llama3)
    assert set(sweep.PEERS) - set(kept) == {"a2a", "tasp", "ring-flash-llama3"}


def test_peers_table_names_the_fastest_peer():
    table = _load("peers_table").table

    def res(**ms):
        methods = {
            m: {mode: {"median": t / 1e3} for mode in ("fwd", "fwdbwd")} for m, t in ms.items()
        }
        return {"ccr": {"fwdbwd": 0.5}, "methods": methods}

    text = table([("p", res(charm=100, ring=300, a2a=150))])
    row = text.splitlines()[2]
    assert "a2a / a2a" in row and "1.50x / 1.50x" in row
    # another method in focus: compared with the fastest of the rest, charm included
    row = table([("p", res(charm=100, ring=300, a2a=150))], "a2a").splitlines()[2]
    assert "charm / charm" in row and "0.67x / 0.67x" in row
    # a head split over the ranks of a node, like a2a+p2p
    fitting = _load("sweep").fitting
    assert fitting(("2x4", "rails", True, 1, 512, 2, "100mbit"), ["a2a+charm"]) == []
    assert fitting(("2x4", "rails", True, 1, 512, 4, "100mbit"), ["a2a+charm"]) == ["a2a+charm"]


def test_gqa_points_split_only_where_the_kv_heads_divide():
    sweep = _load("sweep")
    gqa = sweep.Point("2x4", "rails", True, 1, 512, 8, "400mbit", kv_heads=2)
    # 8 query heads divide 4 ranks per node, 2 kv heads do not: no head split runs
    assert set(sweep.fitting(gqa, sweep.PEERS)) == {
        "charm", "ring", "ring-flash", "ring-flash-llama3", "all_gather"
    }  # fmt: skip
    assert sweep.point_name(gqa) == "2x4-rails-causal-b1-s512-h8-kv2-400mbit"
    cmd = sweep.point_cmd(gqa, "out.json", 3, "charm")
    assert cmd[cmd.index("--kv-heads") + 1] == "2" and cmd[cmd.index("--heads") + 1] == "8"
    # multi-head points keep their names (runs of one point pair up by file name) and pass
    # their own head count as the kv heads
    mha = ("2x2", "shared", True, 1, 512, 8, "200mbit")
    assert sweep.point_name(mha) == "2x2-shared-causal-b1-s512-h8-200mbit"
    cmd = sweep.point_cmd(mha, "out.json", 3, "charm")
    assert cmd[cmd.index("--kv-heads") + 1] == "8"
    assert any(p.kv_heads for p in sweep.POINTS)


def test_methods_expand_peers_and_auto_once_each():
    sweep = _load("sweep")
    from megatron_charm.sim.predict import SIMPLICITY

    assert sorted(sweep.AUTO) == sorted(SIMPLICITY)  # auto's candidates, all of them
    assert sweep.wanted_methods("peers") == sweep.PEERS
    both = sweep.wanted_methods("peers,auto")
    assert both[: len(sweep.PEERS)] == sweep.PEERS
    assert set(both) == set(sweep.PEERS) | set(sweep.AUTO) and len(both) == len(set(both))
    assert "rm+" in both and "merge" in both
    assert sweep.wanted_methods("charm,rm+,charm") == ["charm", "rm+"]
