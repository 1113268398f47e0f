"""predict/advise, the CLI, and the scale target."""

from __future__ import annotations

import json

import pytest

from megatron_charm.plan import METHODS
from megatron_charm.sim import FlopsCompute, Problem, Topology, advise, predict
from megatron_charm.sim.cli import main
from megatron_charm.sim.topology import PRESETS, parse_gpus
from tests.sim.cli_json import run_json

PROBLEM = Problem(batch=2, seq=8192, heads=8, head_dim=64, causal=True)


def test_advise_picks_ring_when_communication_is_free() -> None:
    topo = Topology(2, 4, 1e9, 1e9, intra_lat=0.0, cross_lat=0.0)
    pred = predict(topo, PROBLEM, FlopsCompute(100.0, 0.5, mem_bw=1e9))
    for name, mp in pred.methods.items():  # nothing to hide: every method is its compute
        # (ring-contig's light ranks wait for the heavy ones that send them kv: imbalance)
        assert mp.forward.exposed_max < 1e-9 or name == "ring-contig"
    adv = advise(pred)
    assert adv.method == "ring"
    # the reasons state this problem's numbers: ring's exposure is nil
    assert any(r.startswith("ring: exposed communication") and "(0%)" in r for r in adv.reasons)
    assert any(f"CCR {pred.ccr_forward:.2f}" in r for r in adv.reasons)


def test_advise_picks_charm_when_cross_links_are_slow() -> None:
    topo = Topology(4, 4, 300.0, 5.0)
    pred = predict(topo, PROBLEM, FlopsCompute(400.0, 0.5))
    adv = advise(pred)
    assert adv.method == "charm"
    charm_mb = (
        pred.methods["charm"].forward.link_bytes()["cross"]
        + pred.methods["charm"].backward.link_bytes()["cross"]
    ) / 1e6
    assert any(f"charm {charm_mb:.1f} MB" in r for r in adv.reasons), adv.reasons
    assert pred.speedup("charm") > 1.5 and pred.speedup("charm", backward=True) > 1.5
    assert pred.methods["charm"].forward.exposed_mean < pred.methods["ring"].forward.exposed_mean


def test_charm_moves_less_across_nodes_than_ring_when_causal() -> None:
    pred = predict(Topology(2, 4, 300.0, 20.0), PROBLEM, FlopsCompute(400.0, 0.5))
    cross = {m: pred.methods[m].forward.link_bytes()["cross"] for m in pred.methods}
    assert cross["charm"] < cross["ring"] < cross["rm+"]


def test_ccr_scales_with_local_sequence() -> None:
    compute = FlopsCompute(400.0, 0.5)
    topo = Topology(2, 4, 300.0, 20.0, intra_lat=0.0, cross_lat=0.0)
    a = predict(topo, Problem(1, 8192, 8, 64), compute, ("ring",))
    b = predict(topo, Problem(1, 16384, 8, 64), compute, ("ring",))
    assert b.ccr_forward == pytest.approx(2 * a.ccr_forward)


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = "--gpus 2x4 --intra-bw 365 --cross-bw 42.5 --tflops 989 --batch 2 --seq 8192 "
    args += "--heads 12 --head-dim 128 --causal"
    assert main(args.split()) == 0
    out = capsys.readouterr().out
    # by default every method that fits: 12 heads do not split over 8 GPUs for a2a, and 1024
    # tokens per GPU do not cut into 2 x 7 chunks for tasp
    fits = set(METHODS) - {"a2a", "tasp"}
    for m in METHODS:
        assert (f"\n{m} " in out) == (m in fits), m
    assert "CCR forward" in out
    data = run_json(capsys, [*args.split(), "--json"])
    assert set(data["methods"]) == fits
    sixteen = run_json(capsys, [*args.split(), "--heads", "16", "--json"])
    assert set(sixteen["methods"]) == set(METHODS) - {"tasp"}
    assert data["methods"]["ring"]["forward"]["speedup_vs_ring"] == pytest.approx(1.0)
    assert data["s_local"] == 1024
    # the models and the unit behind the numbers, in the table and the JSON
    assert "links: intra 365 GB/s (nvlink), 4 cross link(s) per node at 42.5 GB/s each" in out
    assert "compute: 989 TFLOPS x 0.5 efficiency = 494.5 TFLOP/s in blocks" in out
    assert "unit: one attention layer, one micro-batch" in out
    assert data["compute"]["kind"] == "FlopsCompute" and data["compute"]["efficiency"] == 0.5
    assert data["unit"].startswith("one attention layer") and "42.5 GB/s" in data["links"]
    assert main([*args.split(), "--enqueue-us", "7"]) == 0
    assert "host enqueue 7/7/7/7 us" in capsys.readouterr().out


def test_cli_says_which_method_it_replays_on_large_groups(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Replays above 32 ranks take seconds each: each gets a line on stderr, stdout stays JSON;
    a small group stays quiet."""
    args = "--gpus 8x8 --intra-bw 365 --cross-bw 42.5 --tflops 989 --seq 32768 --heads 16 "
    args += "--head-dim 64 --methods charm"
    assert main([*args.split(), "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["gpus"] == "8x8"
    lines = got.err.splitlines()
    assert lines == [
        "megatron-charm-sim: replaying ring (1 of 2) on 8x8 ranks",
        "megatron-charm-sim: replaying charm (2 of 2) on 8x8 ranks",
    ]
    assert main([*args.replace("8x8", "4x8").split(), "--json"]) == 0
    assert capsys.readouterr().err == ""
    # a preset's assumed costs are checked by replaying again with one changed: said as such
    preset = "--preset H100 --gpus 8x8 --seq 32768 --heads 16 --head-dim 64 --methods charm"
    assert main([*preset.split(), "--json"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == [
        "megatron-charm-sim: replaying ring (1 of 2) on 8x8 ranks",
        "megatron-charm-sim: replaying charm (2 of 2) on 8x8 ranks",
    ]
    assert len(lines) > 2
    assert all(line.endswith("again, with one cost changed (does the pick depend on it?)")
               for line in lines[2:])  # fmt: skip


def test_cli_advise_with_preset(capsys: pytest.CaptureFixture[str]) -> None:
    args = "advise --preset H100 --gpus 4x8 --batch 1 --seq 65536 --heads 16 --head-dim 128"
    data = run_json(capsys, [*args.split(), "--causal", "--json"])
    # four nodes of H100 at 64K tokens: CHARM+ wins by a wide margin (2.59x over a2a+p2p when
    # this was written), and the first reason says so with its predicted time
    assert data["cp_comm_type"] == "charm"
    first = data["reasons"][0]
    assert first.startswith("predicted forward+backward ") and " ms with charm; next " in first
    assert any(r.startswith("uncertainty: H100 (paper Table 2") for r in data["reasons"])


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--seq", "1001"], "positive and divisible by 8"),
        (["--gpus", "2by8"], "NODESxRANKS_PER_NODE"),
        (["--cross-bw", "0"], "must be > 0"),
        (["--seq", "0"], "must be positive"),
        (["--seq", "-16"], "must be positive"),
        (["--cross-bw", "nan"], "must be > 0"),
        (["--intra-bw", "inf"], "must be > 0"),
        (["--tflops", "nan"], "tflops nan must be > 0"),
        (["--methods", "ring,zigzag"], "not in"),
        (["--methods", "a2a", "--gpus", "2x8", "--seq", "8192"], "h=8 and kv heads h_kv=8"),
    ],
)
def test_cli_rejects_bad_input(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"--gpus": "2x4", "--seq": "8192", "--cross-bw": "42.5", "--methods": "ring"}
    for k, v in zip(extra[::2], extra[1::2], strict=True):
        base[k] = v
    argv = ["--preset", "H100", "--heads", "8", "--head-dim", "64"]
    argv += [x for kv in base.items() for x in kv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_requires_cluster_without_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main("--gpus 2x4 --seq 8192 --heads 8 --head-dim 64".split()) == 2
    assert "--intra-bw is missing" in capsys.readouterr().err


def test_presets_hold_table_2() -> None:
    assert (PRESETS["H100"].tflops, PRESETS["H100"].intra_bw, PRESETS["H100"].cross_bw) == (
        989.0,
        365.1,
        42.5,
    )
    assert PRESETS["L20"].fabric == "pcie" and PRESETS["H20"].fabric == "nvlink"
    assert parse_gpus("16x8") == (16, 8)


def test_cli_l20_shares_one_pcie_domain_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    # Note [One PCIe domain]: the L20 preset (and its profile) shares 24 GB/s per NUMA domain;
    # --pcie-domain-bw 0 gives each GPU its own link only, and ring's transfers speed up
    argv = "--preset L20 --gpus 1x4 --batch 4 --seq 8192 --heads 8 --head-dim 128 --methods ring"
    shared = run_json(capsys, [*argv.split(), "--json"])
    alone = run_json(capsys, [*argv.split(), "--pcie-domain-bw", "0", "--json"])
    assert "24 GB/s per node and direction" in shared["links"]
    assert "per node and direction" not in alone["links"]
    fwd = [r["methods"]["ring"]["forward"]["time_ms"] for r in (shared, alone)]
    assert fwd[0] > 1.5 * fwd[1]
    assert main([*argv.split(), "--pcie-domain-bw", "-1"]) == 2
    assert "pcie_domain -1.0 must be >= 0" in capsys.readouterr().err
    from megatron_charm.sim.profile import load_profile

    assert load_profile("L20").topology(2, 4).pcie_domain == PRESETS["L20"].pcie_domain == 24.0
    assert load_profile("H100").topology(2, 8).pcie_domain == 0.0


def _scale(method: str):
    topo = Topology(128, 8, 365.1, 42.5)
    pred = predict(topo, Problem(1, 4096 * 1024, 16, 128, causal=True), FlopsCompute(989.0, 0.5),
                   (method,))  # fmt: skip
    return pred.methods[method]


def test_128x8_replays_one_node() -> None:
    """What keeps 1024 ranks tractable: node 0's 8 ranks are replayed under node symmetry (the
    time it takes is a benchmark, docs/simulator.md, not a test)."""
    mp = _scale("charm")
    for res in (mp.forward, mp.backward):
        assert res.makespan > 0 and len(res.ranks) == 8 and not res.exact


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "merge", "rm+"])
def test_128x8_other_methods_replay_one_node(method: str) -> None:
    mp = _scale(method)
    assert len(mp.forward.ranks) == len(mp.backward.ranks) == 8


def test_cli_runs_presets_as_tiles_and_sms_overrides() -> None:
    from megatron_charm.sim.cli import _resolve, build_parser

    def compute(argv: str):
        args = build_parser().parse_args(argv.split())
        return _resolve(args)[2]

    base = "--seq 8192 --heads 8 --head-dim 64 --gpus 2x4"
    assert compute(f"--preset H100 {base}").sms == 132  # Note [Tiles and waves]
    assert compute(f"--preset H100 {base} --sms 0").sms == 0
    assert compute(f"--preset H100 {base} --efficiency 0.5").sms == 132
    flags = "--intra-bw 300 --cross-bw 40 --tflops 500"
    assert compute(f"{flags} {base}").sms == 0
    assert compute(f"{flags} {base} --sms 100").sms == 100


def test_cli_runs_a_presets_tasp_on_its_all_to_all_links(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = "--preset H100 --gpus 2x8 --batch 1 --seq 3360 --heads 12 --head-dim 192 --json"
    data = run_json(capsys, [*base.split(), "--methods", "ring,tasp"])
    assert "one NIC per GPU" in data["tasp_links"]
    # the same preset with its links given by a flag: tasp on those links, slower
    flagged = run_json(capsys, [*base.split(), "--methods", "ring,tasp", "--cross-bw", "26.35"])
    assert "tasp_links" not in flagged
    on_a2a, on_flags = (d["methods"]["tasp"]["forward"]["time_ms"] for d in (data, flagged))
    assert on_a2a < on_flags
    # the paper's schedules: its TASP has no backward, so the one replayed is said to be ours
    assert "backward is our planner's" not in data["tasp_links"]
    paper = run_json(capsys, [*base.split(), "--methods", "ring,tasp", "--replay", "paper"])
    assert "backward is our planner's" in paper["tasp_links"]


def test_cli_replays_the_papers_schedules_next_to_its_table_5(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Table 5's first 2 x 8 row: ring 149.97 ms, CHARM+ 2.35x forward / 3.18x backward
    base = "--preset H100 --gpus 2x8 --batch 16 --seq 26880 --heads 12 --head-dim 192 --json"
    paper = run_json(capsys, [*base.split(), "--replay", "paper"])
    assert paper["replay"]["schedules"] == "paper"
    assert set(paper["methods"]) == {"ring", "charm"}  # its default methods
    speedups = (paper["methods"]["charm"][p]["speedup_vs_ring"] for p in ("forward", "backward"))
    assert next(speedups) == pytest.approx(2.35, rel=0.1)
    assert next(speedups) == pytest.approx(3.18, rel=0.1)
    assert paper["methods"]["ring"]["forward"]["time_ms"] == pytest.approx(149.97, rel=0.06)
    # our schedules: a ring forward that overlaps, a charm that keeps its crossed queries
    ours = run_json(capsys, [*base.split(), "--methods", "ring,charm"])
    assert ours["replay"]["schedules"] == "ours"
    for name in ("ring", "charm"):
        assert (
            ours["methods"][name]["forward"]["time_ms"]
            < paper["methods"][name]["forward"]["time_ms"]
        )
    assert main(base.replace("--json", "--replay paper").split()) == 0
    assert capsys.readouterr().out.startswith("schedules: the paper's ring, CHARM+ and RM+")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--methods", "ring,a2a"], "--methods a2a: --replay paper replays ring, ring-contig"),
        (["--window", "4"], "--window set our schedules' options"),
        (["--mode", "full"], "--mode set our schedules' options"),
    ],
)
def test_cli_replay_paper_refuses_what_it_cannot_replay(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = "--preset H100 --gpus 2x4 --seq 8192 --heads 8 --head-dim 64 --replay paper".split()
    assert main([*base, *extra]) == 2
    assert message in capsys.readouterr().err
    assert main(["advise", *base]) == 2
    assert "advise recommends one of this package's schedules" in capsys.readouterr().err


def test_cli_prints_the_ccrs_two_sums_as_table_5_gives_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Table 5's 2 x 8 ring forward rows 1 and 3 (same bytes, FLOPs 8 : 2) give its blocks 10.96
    # ms and its transfers 139.0 ms at batch 16 and 26,880 tokens (Note [The paper's baselines])
    base = "--preset H100 --gpus 2x8 --batch 16 --seq 26880 --heads 12 --head-dim 192 --json"
    ccr = run_json(capsys, [*base.split(), "--replay", "paper"])["ccr"]
    comp, comm = ccr["t_comp_ms"]["forward"], ccr["t_comm_ms"]["forward"]
    assert comp == pytest.approx(10.96, rel=0.12) and comm == pytest.approx(139.0, rel=0.05)
    assert ccr["forward"] == pytest.approx(comp / comm)
    assert ccr["t_comm_ms"]["backward"] > 2 * comm  # the backward moves a float32 dkv too
    assert main(base.replace(" --json", "").split()) == 0
    assert f"T_comp / T_comm {comp:.3g} / {comm:.3g} ms forward" in capsys.readouterr().out


def test_cli_prints_the_ccr_at_table_2s_rates_where_a_preset_runs_below_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the paper's Eq. 9 takes a transfer as its bytes over Table 2's bandwidth: Table 5's first
    # 2 x 8 row moves 15 kv of 16 x 1,680 tokens x 12 x 192 (k and v, bf16) at 42.5 GB/s
    base = "--preset H100 --gpus 2x8 --batch 16 --seq 26880 --heads 12 --head-dim 192 --json"
    ccr = run_json(capsys, base.split())["ccr"]
    kv = 16 * 1680 * 12 * 192 * 2 * 2
    table2 = ccr["table2"]
    assert table2["t_comm_ms"]["forward"] == pytest.approx(15 * kv / 42.5e9 * 1e3, rel=1e-6)
    assert table2["forward"] == pytest.approx(ccr["t_comp_ms"]["forward"] / (15 * kv / 42.5e6))
    assert table2["forward"] > ccr["forward"] * 1.5  # in-schedule transfers run at 0.62 of it
    assert table2["t_comm_ms"]["backward"] > 2 * table2["t_comm_ms"]["forward"]
    assert main(base.replace(" --json", "").split()) == 0
    line = "CCR at Table 2's rates, as the paper counts it (bytes over its measured bandwidth): "
    assert f"{line}forward {table2['forward']:.3f}" in capsys.readouterr().out
    # one rank sends nothing: both CCRs are infinite, not a division by zero
    assert main("--preset H100 --gpus 1x1 --seq 1024 --heads 4 --head-dim 64".split()) == 0
    assert "as the paper counts it (bytes over its measured bandwidth): forward inf" in (
        capsys.readouterr().out
    )
    # none where the preset's transfers run at Table 2's rate, or the links are given
    for other in ("--preset L20 --gpus 2x4", "--preset H100 --gpus 2x8 --cross-bw 30"):
        args = f"{other} --batch 2 --seq 8192 --heads 8 --head-dim 64 --json --methods ring"
        assert "table2" not in run_json(capsys, args.split())["ccr"]


def test_cli_replays_the_papers_ring_attention_and_ring_zigzag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # causal: the paper's Ring-Attention (contiguous layout) has its last rank compute every
    # block, Ring-Zigzag balances them; both run their forward without overlap
    base = "--preset H100 --gpus 2x8 --batch 4 --seq 65536 --heads 12 --head-dim 192 --causal"
    base += " --methods ring,ring-contig --json"
    times = {}
    for replay in ("paper", "ours"):
        got = run_json(capsys, [*base.split(), "--replay", replay])["methods"]
        times[replay] = {m: got[m]["forward"]["time_ms"] for m in ("ring", "ring-contig")}
    assert times["paper"]["ring-contig"] > times["paper"]["ring"] * 1.05
    for method in ("ring", "ring-contig"):  # without overlap: slower than our own
        assert times["paper"][method] > times["ours"][method] * 1.05


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ("--heads 12 --kv-heads 5", "--kv-heads 5"),
        ("--heads 12 --kv-heads 0", "--kv-heads 0"),  # was one kv head, silently
        ("--heads 12 --batch 0", "--batch 0"),
    ],
)
def test_cli_names_the_flags_of_a_head_split_it_refuses(
    flags: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = "--preset H100 --gpus 2x4 --seq 8192 --head-dim 64".split()
    assert main([*base, *flags.split()]) == 2
    err = capsys.readouterr().err
    assert named in err and "--heads 12" in err
    assert "change --heads or --kv-heads" in err
