"""CP groups sharing their nodes (Note [Groups sharing a node]): the links, the heads, the CLI."""

from __future__ import annotations

import pytest

from megatron_charm.sim import FlopsCompute, Problem, Topology, predict
from megatron_charm.sim.cli import main
from megatron_charm.sim.node_groups import per_rank_heads, shared_by
from megatron_charm.sim.topology import PRESETS
from tests.sim.cli_json import run_json


def test_one_group_is_the_topology_itself() -> None:
    topo = Topology(2, 4, 300.0, 20.0, cross_links="shared")
    assert shared_by(topo, 1) is topo


@pytest.mark.parametrize(
    ("links", "nics"), [("shared", 0), ("rails", 2), ("rails", 4), ("shared", 2)]
)
def test_links_of_the_node_are_shared_by_its_groups(links: str, nics: int) -> None:
    topo = Topology(2, 4, 300.0, 20.0, cross_links=links, nics_per_node=nics)
    got = shared_by(topo, 4)
    assert got.cross_bw == pytest.approx(5.0)
    assert got.nics == topo.nics  # the same links, a quarter of each for this group
    assert (got.intra_bw, got.cross_lat, got.nvlink_egress) == (300.0, topo.cross_lat, 0.0)


def test_a_nic_per_gpu_and_a_gpus_own_links_are_not_shared() -> None:
    topo = Topology(2, 4, 300.0, 20.0, cross_links="rails", nvlink_egress=450.0)
    assert shared_by(topo, 2) == topo
    pcie = Topology(2, 4, 24.0, 14.7, fabric="pcie", cross_links="rails")
    assert shared_by(pcie, 2) == pcie  # no root complex: each GPU's own PCIe link


def test_the_root_complex_is_shared_and_a_fixed_cost_on_the_link_is_paid_by_every_group() -> None:
    l20 = PRESETS["L20"].topology(2, 4)
    got = shared_by(l20, 2)
    assert got.pcie_domain == pytest.approx(l20.pcie_domain / 2) and l20.pcie_domain > 0
    h20 = PRESETS["H20"].topology(2, 4)
    assert h20.cross_lat_on_link
    got = shared_by(h20, 3)
    assert got.cross_lat == pytest.approx(3 * h20.cross_lat)
    assert got.cross_bw == pytest.approx(h20.cross_bw / 3)
    # where the fixed cost is a delay before the bytes, each group's waits run side by side
    h100 = PRESETS["H100"].topology(2, 4)
    assert shared_by(h100, 2).cross_lat == h100.cross_lat


@pytest.mark.parametrize("groups", [0, -1, 1.5, True, "2"])
def test_bad_group_counts_raise(groups: object) -> None:
    with pytest.raises(ValueError, match="groups per node .* must be an integer >= 1"):
        shared_by(Topology(2, 4, 300.0, 20.0), groups)  # type: ignore[arg-type]


def test_heads_per_tensor_parallel_rank() -> None:
    assert per_rank_heads(32, 8, 1) == (32, 8)
    assert per_rank_heads(32, 8, 4) == (8, 2)
    # fewer query groups than TP ranks: each rank holds one kv head (Megatron core 0.16)
    assert per_rank_heads(32, 8, 16) == (2, 1)
    assert per_rank_heads(32, 1, 4) == (8, 1)
    with pytest.raises(ValueError, match="--kv-heads 6 a multiple or a divisor of it"):
        per_rank_heads(48, 6, 4)
    with pytest.raises(ValueError, match="--heads 12 must be divisible by --tp 8"):
        per_rank_heads(12, 4, 8)
    with pytest.raises(ValueError, match="--tp 0 must be an integer >= 1"):
        per_rank_heads(32, 8, 0)


def test_shared_links_slow_the_cross_bound_methods() -> None:
    problem = Problem(1, 32768, 8, 128, causal=True)
    compute = FlopsCompute(400.0, 0.5)
    topo = Topology(2, 4, 300.0, 10.0, cross_links="shared")
    alone = predict(topo, problem, compute, ("ring", "charm"))
    shared = predict(shared_by(topo, 2), problem, compute, ("ring", "charm"))
    for method in ("ring", "charm"):
        assert shared.methods[method].total > alone.methods[method].total
    # the bytes are the same: only the rate of the links they cross changed
    assert shared.methods["ring"].forward.link_bytes() == alone.methods["ring"].forward.link_bytes()


ARGS = ["--preset", "H100", "--gpus", "2x4", "--batch", "1", "--seq", "32768", "--head-dim", "128"]


def test_cli_tp_divides_the_heads_and_shares_the_nodes_links(
    capsys: pytest.CaptureFixture[str],
) -> None:
    alone = run_json(capsys, [*ARGS, "--heads", "16", "--kv-heads", "8"])
    tp = run_json(capsys, [*ARGS, "--heads", "32", "--kv-heads", "16", "--tp", "2"])
    assert alone["node_groups"] == {"tp": 1, "groups_per_node": 1}
    assert tp["node_groups"]["groups_per_node"] == 2
    assert "16 of 32 query heads and 8 of 16 kv heads" in tp["node_groups"]["note"]

    # the same per-rank problem, so the same bytes; the H100 preset's two links per node are
    # shared by the two TP ranks' CP groups, so every method that crosses nodes takes longer
    def ms(data: dict, method: str) -> float:
        return sum(data["methods"][method][p]["time_ms"] for p in ("forward", "backward"))

    ring = (alone["methods"]["ring"], tp["methods"]["ring"])
    assert ring[0]["forward"]["bytes_per_link"] == ring[1]["forward"]["bytes_per_link"]
    for method in ("ring", "charm"):
        assert ms(tp, method) > ms(alone, method)
    more = run_json(capsys, [*ARGS, "--heads", "32", "--tp", "2", "--groups-per-node", "4"])
    assert more["node_groups"]["groups_per_node"] == 4
    assert ms(more, "ring") > ms(tp, "ring")


def test_cli_says_what_tp_changed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--heads", "32", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 2: each CP rank holds 16 of 32 query heads" in out
    assert "2 CP group(s) per node share its links" in out
    assert main(["advise", *ARGS, "--heads", "32", "--tp", "2"]) == 0
    assert "  - tensor parallel 2:" in capsys.readouterr().out
    assert main([*ARGS, "--heads", "32"]) == 0
    assert "tensor parallel" not in capsys.readouterr().out
    assert main([*ARGS, "--heads", "32", "--kv-heads", "2", "--tp", "4"]) == 0
    assert "8 of 32 query heads and 1 of 2 kv heads" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--heads", "48", "--kv-heads", "6", "--tp", "4"], "a multiple or a divisor of it"),
        (["--heads", "32", "--tp", "0"], "--tp 0 must be an integer >= 1"),
        (["--heads", "32", "--groups-per-node", "0"], "groups per node 0 must be an integer"),
    ],
)
def test_cli_refuses_bad_tp_and_groups(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main([*ARGS, *extra]) == 2
    assert message in capsys.readouterr().err


def test_auto_chooses_on_the_links_its_groups_leave_it() -> None:
    from megatron_charm.auto import choose_method
    from megatron_charm.plan.payloads import AttnShape
    from megatron_charm.plan.types import Layout

    shape = AttnShape(1, 4096, 16, 4, 128, 2)
    alone = choose_method("H100", Layout(2, 4), shape, True)
    shared = choose_method("H100", Layout(2, 4), shape, True, groups_per_node=2)
    assert (alone.groups_per_node, shared.groups_per_node) == (1, 2)
    assert "2 CP groups per node" in shared.describe()
    assert "CP groups per node" not in alone.describe()
    # H100's two links per node carry both groups' bytes: every method that crosses nodes
    # predicts slower; a choice cached for one count is not reused for the other
    for method, seconds in alone.predicted_s.items():
        assert shared.predicted_s[method] > seconds, method


def test_auto_replays_one_node_above_64_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank pays the runtime choice's replays at its first call: they keep the 64-rank
    limit for full replays, where the CLI replays up to 128 ranks in full."""
    import importlib

    from megatron_charm.auto import RUNTIME_FULL_MAX_RANKS, choose_method
    from megatron_charm.plan.payloads import AttnShape
    from megatron_charm.plan.types import Layout

    # the package re-exports the function under the module's name
    sim_predict = importlib.import_module("megatron_charm.sim.predict")
    limits: list[int] = []
    real = sim_predict.predict

    def spy(*args, **kwargs):
        limits.append(kwargs["full_max_ranks"])
        return real(*args, **kwargs)

    monkeypatch.setattr(sim_predict, "predict", spy)
    monkeypatch.setattr(importlib.import_module("megatron_charm.auto"), "_CACHE", {})
    choose_method("H100", Layout(2, 2), AttnShape(1, 1024, 8, 8, 64, 2), True)
    assert RUNTIME_FULL_MAX_RANKS == 64 and limits and set(limits) == {64}


def test_runtime_auto_replays_only_methods_it_can_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The baselines are never picked, so the runtime choice does not replay them (on 32 x 8
    causal ring-contig and a2a+charm replay every rank: 27 of 30 s)."""
    import importlib

    from megatron_charm.auto import choose_method
    from megatron_charm.plan.options import BASELINES
    from megatron_charm.plan.payloads import AttnShape
    from megatron_charm.plan.types import Layout

    sim_predict = importlib.import_module("megatron_charm.sim.predict")
    replayed: list[tuple[str, ...]] = []
    real = sim_predict.predict

    def spy(*args, **kwargs):
        pred = real(*args, **kwargs)
        replayed.append(tuple(pred.methods))
        return pred

    monkeypatch.setattr(sim_predict, "predict", spy)
    monkeypatch.setattr(importlib.import_module("megatron_charm.auto"), "_CACHE", {})
    choice = choose_method("H100", Layout(2, 2), AttnShape(1, 1024, 8, 8, 64, 2), True)
    assert {"charm", "ring", "a2a+p2p"} <= set(replayed[0])
    assert not set(BASELINES) & {m for methods in replayed for m in methods}
    assert choice.method in replayed[0] and set(choice.predicted_s) == set(replayed[0])


def test_cli_leaves_the_all_to_alls_nic_per_gpu_unshared(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--preset", "H100", "--gpus", "2x8", "--seq", "26880", "--head-dim", "192"]
    argv += ["--methods", "ring,tasp"]
    lines = []
    for extra in (["--heads", "12"], ["--heads", "24", "--tp", "2"]):
        assert main([*argv, *extra]) == 0
        out = capsys.readouterr().out
        lines.append(next(x for x in out.splitlines() if x.startswith("tasp: its all-to-all")))
    assert lines[0] == lines[1] and "20.4 GB/s each" in lines[0]


@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 0), (0, 8), (-4, 2)])
def test_heads_per_tensor_parallel_rank_refuses_a_count_below_one(
    heads: int, kv_heads: int
) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        per_rank_heads(heads, kv_heads, 1)
