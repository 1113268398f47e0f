"""Profiles: fitting (Note [Fitting a profile]), loading, the simulator CLI on a profile, and the
``auto`` method choice (Note [Choosing a method])."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megatron_charm.auto import choose_method
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Layout
from megatron_charm.sim.cli import main
from megatron_charm.sim.compute import FittedCompute
from megatron_charm.sim.profile import (
    Profile,
    block_flops_full,
    fit_line,
    fit_link,
    fit_profile,
    load_profile,
    preset_profile,
)
from megatron_charm.sim.topology import PRESETS

# The "true" machine the synthetic samples come from.
FWD_RATE, BWD_RATE, FWD_OVER, BWD_OVER = 3e10, 2e10, 2e-4, 5e-4
INTRA_BW, INTRA_LAT, CROSS_BW, CROSS_LAT = 2.0, 1e-4, 0.0125, 3e-4  # GB/s, s
MEM_BW = 4.0


def _raw(m: int = 2, p: int = 2, flows_per_link: int = 2) -> dict:
    kernel = []
    for tokens in (256, 512, 1024, 2048):
        flops = block_flops_full(1, 8, 64, tokens)
        kernel.append(
            {
                "batch": 1,
                "heads": 8,
                "head_dim": 64,
                "tokens": tokens,
                "fwd_s": FWD_OVER + flops / FWD_RATE,
                "bwd_s": BWD_OVER + 2.5 * flops / BWD_RATE,
            }
        )
    sizes = (65536, 262144, 1048576, 4194304)

    def link(bw, lat):
        return [{"bytes": n, "s": lat + n / (bw * 1e9)} for n in sizes]

    big = max(sizes)
    return {
        "nodes": m,
        "ranks_per_node": p,
        "device": "cpu",
        "dtype": "bf16",
        "backend": "gloo",
        "kernel": kernel,
        "merge": [{"bytes": n, "s": 3 * n / (MEM_BW * 1e9)} for n in sizes],
        "p2p": {"intra": link(INTRA_BW, INTRA_LAT), "cross": link(CROSS_BW, CROSS_LAT)},
        "concurrent_cross": {
            "flows": p,
            "bytes": big,
            "s": CROSS_LAT + big * flows_per_link / (CROSS_BW * 1e9),
        },
    }


def test_fit_profile_reads_a_shared_pcie_domain_from_concurrent_intra_pairs() -> None:
    # Note [One PCIe domain]: two disjoint pairs of one node at once, each at half one pair's
    # rate, share a domain of one pair's rate; at full rate they share nothing. Only with a PCIe
    # fabric: NVLink's flows do not share a root complex.
    big = 4194304

    def conc(per_flow_gbs: float) -> dict:
        return {"flows": 2, "bytes": big, "s": INTRA_LAT + big / (per_flow_gbs * 1e9)}

    shared = {**_raw(1, 4), "concurrent_intra": conc(INTRA_BW / 2)}
    prof = fit_profile(shared, fabric="pcie")
    assert prof.pcie_domain == pytest.approx(INTRA_BW, rel=1e-6)
    assert prof.topology(1, 4).pcie_domain == prof.pcie_domain
    assert fit_profile(shared).pcie_domain == 0.0  # nvlink, the default
    alone = {**_raw(1, 4), "concurrent_intra": conc(INTRA_BW * 0.95)}  # noise, not sharing
    assert fit_profile(alone, fabric="pcie").pcie_domain == 0.0
    assert fit_profile(_raw(1, 4), fabric="pcie").pcie_domain == 0.0  # not timed


def test_fit_line_recovers_a_line_and_keeps_the_intercept_non_negative() -> None:
    xs = [1.0, 2.0, 4.0, 8.0]
    a, b = fit_line(xs, [3.0 + 2.0 * x for x in xs])
    assert a == pytest.approx(3.0) and b == pytest.approx(2.0)
    # noise that would give a negative intercept: refit through the origin
    a, b = fit_line([1.0, 2.0, 3.0], [0.5, 2.0, 3.5])
    assert a == 0.0 and b > 0
    with pytest.raises(ValueError, match="positive samples"):
        fit_line([1.0], [0.0])


def test_a_shapers_burst_does_not_raise_the_fitted_link_rate() -> None:
    # 12.5 MB/s, no latency, but the smallest transfer rides a token bucket's burst (the testbed
    # measured 18 MB/s for 64 KiB): the sustained rate is the large transfers'
    xs = [65536.0, 262144.0, 1048576.0, 4194304.0]
    ys = [x / 12.5e6 for x in xs]
    ys[0] = xs[0] / 18.4e6
    lat, inv_bw = fit_link(xs, ys)
    assert 1.0 / inv_bw == pytest.approx(12.5e6, rel=1e-3) and lat == 0.0
    assert 1.0 / fit_line(xs, ys)[1] > 13e6  # a fit through every sample is raised by it
    # a real latency is kept
    lat, inv_bw = fit_link(xs, [2e-4 + x / 12.5e6 for x in xs])
    assert lat == pytest.approx(2e-4) and 1.0 / inv_bw == pytest.approx(12.5e6)


def test_fit_profile_recovers_the_machine_that_made_the_samples() -> None:
    prof = fit_profile(_raw())
    c = prof.compute_model()
    assert isinstance(c, FittedCompute)
    assert c.fwd_flops_per_s == pytest.approx(FWD_RATE, rel=1e-6)
    assert c.bwd_flops_per_s == pytest.approx(BWD_RATE, rel=1e-6)
    assert c.fwd_overhead == pytest.approx(FWD_OVER, rel=1e-6)
    assert c.bwd_overhead == pytest.approx(BWD_OVER, rel=1e-6)
    assert c.mem_bw == pytest.approx(MEM_BW, rel=1e-6)
    assert prof.intra_bw == pytest.approx(INTRA_BW, rel=1e-6)
    assert prof.cross_bw == pytest.approx(CROSS_BW, rel=1e-6)
    assert prof.cross_lat == pytest.approx(CROSS_LAT, rel=1e-6)
    assert max(prof.fit_error.values()) < 1e-6
    # two flows at half the rate each: one link per node
    assert prof.nics_per_node == 1 and prof.topology(2, 2).cross_links == "shared"


@pytest.mark.parametrize(
    ("p", "flows_per_link", "links"), [(2, 1, 0), (8, 4, 2), (8, 8, 1), (4, 1, 0)]
)
def test_links_per_node_come_from_the_concurrent_timing(p, flows_per_link, links) -> None:
    prof = fit_profile(_raw(p=p, flows_per_link=flows_per_link))
    assert prof.nics_per_node == links
    topo = prof.topology(2, p)
    assert topo.nics == (links or p)


def test_profile_round_trips_and_bad_files_are_refused(tmp_path) -> None:
    prof = fit_profile(_raw())
    path = tmp_path / "p.json"
    prof.save(path)
    back = load_profile(str(path))
    assert back == prof
    with pytest.raises(ValueError, match="neither a preset"):
        load_profile(str(tmp_path / "missing.json"))
    (tmp_path / "old.json").write_text(json.dumps({"format": "something/0"}))
    with pytest.raises(ValueError, match="expected 'megatron-charm-profile/1'"):
        load_profile(str(tmp_path / "old.json"))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_profile(str(tmp_path / "broken.json"))
    bad = prof.to_json() | {"compute": {"kind": "fitted", "fwd_flops_per_s": -1.0}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError):
        load_profile(str(tmp_path / "bad.json"))


def test_presets_are_profiles_that_say_they_were_not_measured() -> None:
    for name in ("H100", "h20", "L20"):
        prof = load_profile(name)
        assert not prof.measured and "not measured" in prof.name
        assert prof.known_error is None
    assert preset_profile("L20").topology(2, 4).cross_links == "shared"
    assert preset_profile("H100").topology(4, 8).nics == 2
    # H20: four links, its fixed cost on them (Note [A fixed cost on the link]), as the preset
    h20 = preset_profile("H20").topology(2, 8)
    assert h20 == PRESETS["H20"].topology(2, 8)
    assert h20.nics == 4 and h20.cross_lat_on_link and h20.latency("cross") == 0.0
    assert not preset_profile("H100").topology(4, 8).cross_lat_on_link


@pytest.mark.parametrize(
    ("lat", "on_link", "links", "want"),
    [
        (1.09e-3, True, 4, (4, True)),  # H20-like: a millisecond per transfer, paid per flow
        (1.09e-3, False, 4, (4, False)),  # the same cost as a delay
        (1.09e-3, True, 1, (1, True)),
        (1e-6, True, 4, (4, False)),  # a wire latency: the two readings differ by under 25%
    ],
)
def test_calibrate_tells_a_fixed_cost_on_the_link_from_a_delay(lat, on_link, links, want) -> None:
    # Note [Fitting a profile]: every rank of node 0 ping-pongs with its counterpart at once, at
    # the largest and at the smallest size; k flows on a link take k (lat + n / bw) with the
    # fixed cost on the link, lat + k n / bw as a delay
    p, gbs = 8, 10.7
    raw = _raw(m=2, p=p)
    sizes = [s["bytes"] for s in raw["p2p"]["cross"]]
    raw["p2p"]["cross"] = [{"bytes": n, "s": lat + n / (gbs * 1e9)} for n in sizes]
    flows = p // links

    def conc(n: int) -> dict:
        wire = n / (gbs * 1e9)
        s = flows * (lat + wire) if on_link else lat + flows * wire
        return {"flows": p, "bytes": n, "s": s}

    raw["concurrent_cross"] = {**conc(max(sizes)), "small": conc(min(sizes))}
    prof = fit_profile(raw)
    assert (prof.topology(2, p).nics, prof.cross_lat_on_link) == want
    assert prof.topology(2, p).cross_lat_on_link == want[1]
    # without the small timing (calibrations before it): a delay, links from the large one
    del raw["concurrent_cross"]["small"]
    assert not fit_profile(raw).cross_lat_on_link


def test_a_link_count_that_does_not_divide_falls_back_to_rails() -> None:
    prof = fit_profile(_raw(p=8, flows_per_link=4))  # 2 links per node
    assert prof.topology(2, 3).cross_links == "rails" and prof.topology(2, 3).nics == 3


def test_the_cli_predicts_on_a_profile(tmp_path, capsys) -> None:
    path = tmp_path / "p.json"
    fit_profile(_raw()).save(path)
    args = ["--seq", "8192", "--heads", "8", "--head-dim", "64", "--causal"]
    assert main(["--profile", str(path), "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == "2x2" and out["topology"]["cross_links"] == "shared"
    assert out["topology"]["cross_bw"] == pytest.approx(CROSS_BW)
    assert main(["advise", "--profile", str(path), "--gpus", "4x2", *args]) == 0
    assert "recommended: --cp-comm-type" in capsys.readouterr().out
    assert main(["--profile", str(path), "--preset", "H100", *args]) == 2
    assert "pass one of them" in capsys.readouterr().err


SHAPE = AttnShape(1, 2048, 8, 8, 64, 2)


def test_auto_picks_charm_on_a_slow_shared_link_and_caches_it() -> None:
    prof = fit_profile(_raw())
    # at 2048 tokens per rank a2a comes within 0.1% of charm on this profile (both ship the
    # smaller backward bundle); at 1024 charm's margin is 1.15x
    shape = AttnShape(1, 1024, 8, 8, 64, 2)
    choice = choose_method(prof, Layout(2, 2), shape, True)
    assert choice.method == "charm", choice.describe()
    assert choice.margin > 1.0 and "charm" in choice.describe()
    assert set(choice.predicted_s) >= {"ring", "charm", "all_gather", "a2a"}
    assert choose_method(prof, Layout(2, 2), shape, True) is choice


def test_the_gloo_tiers_profiles_pick_charm_and_all_gather() -> None:
    """tests/gloo's auto tests rely on these two choices for 4 query heads over 2 kv heads."""
    from tests.gloo.tasks import link_profile

    tiny = AttnShape(1, 8, 4, 2, 8, 4)
    assert choose_method(link_profile(slow=True), Layout(2, 2), tiny, True).method == "charm"
    fast = choose_method(link_profile(slow=False), Layout(2, 2), tiny, True)
    assert fast.method == "all_gather" and "simpler" in fast.describe()


def _warned_at_two_shapes(caplog: pytest.LogCaptureFixture, prof: Profile) -> list[str]:
    """The WARNINGs that ``auto`` logs choosing for ``prof`` at two shapes: a profile's warning
    comes once, not once per shape."""
    with caplog.at_level("WARNING", logger="megatron_charm"):
        choose_method(prof, Layout(2, 2), SHAPE, True)
        choose_method(prof, Layout(2, 2), AttnShape(1, 1024, 8, 8, 64, 2), True)
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_auto_warns_once_when_the_profile_was_calibrated_on_another_gpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dataclasses import replace

    import megatron_charm.bench.provenance as provenance

    prof = fit_profile(_raw())
    prof = replace(prof, provenance={**prof.provenance, "host": {"gpu": "NVIDIA H100 80GB HBM3"}})
    here = {"cpu": "x", "cores": 2, "isa": [], "torch": "2.13.0", "gpu": "NVIDIA H200"}
    monkeypatch.setattr(provenance, "host", lambda: here)
    warned = _warned_at_two_shapes(caplog, prof)
    assert len(warned) == 1, warned
    assert "calibrated on another host (gpu: NVIDIA H100 80GB HBM3 vs NVIDIA H200)" in warned[0]
    caplog.clear()
    # the same GPU, whatever the CPU next to it: nothing to say
    same = dict(here, cpu="y", cores=64, gpu="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(provenance, "host", lambda: same)
    with caplog.at_level("WARNING", logger="megatron_charm"):
        choose_method(replace(prof, name="same-gpu"), Layout(2, 2), SHAPE, True)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # a CPU testbed's profile on a GPU rank describes neither its kernels nor its links
    cpu_prof = replace(prof, name="cpu-prof", provenance={"host": dict(here, gpu=None)})
    with caplog.at_level("WARNING", logger="megatron_charm"):
        choose_method(cpu_prof, Layout(2, 2), SHAPE, True)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert ["gpu: none (CPU ranks) vs NVIDIA H100 80GB HBM3" in w for w in warned] == [True]


def test_auto_warns_once_when_a_cpu_profile_was_calibrated_on_another_cpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # results/calibrated-2x2.md, "A third host": an EPYC profile on a Xeon with AMX
    from dataclasses import replace

    import megatron_charm.bench.provenance as provenance

    epyc = {"cpu": "AMD EPYC", "cores": 2, "isa": ["avx2"], "torch": "2.13.0", "gpu": None}
    prof = replace(fit_profile(_raw()), name="epyc", provenance={"host": epyc})
    xeon = dict(epyc, cpu="Intel(R) Xeon(R) Processor", isa=["avx2", "amx_bf16"], torch="2.14")
    monkeypatch.setattr(provenance, "host", lambda: xeon)
    warned = _warned_at_two_shapes(caplog, prof)
    assert len(warned) == 1, warned
    assert "profile 'epyc' was calibrated on another host (cpu: AMD EPYC vs Intel" in warned[0]
    assert "isa: ['avx2'] vs ['avx2', 'amx_bf16']" in warned[0] and "torch" not in warned[0]
    caplog.clear()
    # the same CPU (torch's version aside), a profile that records no host, or a preset
    for other, here in (
        (replace(prof, name="same-cpu"), dict(epyc, torch="2.14")),
        (replace(prof, name="unrecorded", provenance={"host": "not recorded"}), xeon),
        ("H100", xeon),
    ):
        monkeypatch.setattr(provenance, "host", lambda here=here: here)
        with caplog.at_level("WARNING", logger="megatron_charm"):
            choose_method(other, Layout(2, 2), SHAPE, True)
        assert not [r for r in caplog.records if "another host" in r.getMessage()], other
    # more cores on the same CPU model: the ranks share fewer of them there
    monkeypatch.setattr(provenance, "host", lambda: dict(epyc, cores=16))
    caplog.clear()
    with caplog.at_level("WARNING", logger="megatron_charm"):
        choose_method(replace(prof, name="epyc-16"), Layout(2, 2), SHAPE, True)
    warned = [r.getMessage() for r in caplog.records if "another host" in r.getMessage()]
    assert ["cores: 2 vs 16" in w for w in warned] == [True]


def test_auto_warns_once_of_a_profile_calibrated_on_a_moving_machine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Note [Repeated calibrations], Note [A calibration's drift]: runs that predict 21% apart
    from dataclasses import replace

    prof = fit_profile(_raw())
    moving = replace(prof, name="moving", fit_error={**prof.fit_error, "repeat": 0.21})
    warned = _warned_at_two_shapes(caplog, moving)
    assert len(warned) == 1, warned
    assert "profile 'moving': the runs' own profiles predict up to 21% apart" in warned[0]
    assert "calibrate --repeat 3` again" in warned[0]
    caplog.clear()
    steady = replace(prof, name="steady", fit_error={**prof.fit_error, "repeat": 0.05})
    with caplog.at_level("WARNING", logger="megatron_charm"):
        choose_method(steady, Layout(2, 2), SHAPE, True)
        choose_method("H100", Layout(2, 2), SHAPE, True)  # a preset: nothing measured
    assert not [r for r in caplog.records if "speed moved" in r.getMessage()]


def test_auto_names_a_missing_profile() -> None:
    with pytest.raises(ValueError, match="megatron-charm-sim calibrate"):
        choose_method("no-such-profile.json", Layout(2, 2), SHAPE, True)


def test_blocks_that_overlap_transfers_pay_the_measured_slowdown() -> None:
    from dataclasses import replace

    from megatron_charm.sim import Problem, Topology, predict

    base = FittedCompute(1e10, 1e10, mem_bw=10.0)
    slow = replace(base, fwd_slowdown=2.0, bwd_slowdown=2.0)
    problem = Problem(1, 8192, 8, 64, causal=True)
    topo = Topology(2, 2, 1.0, 0.01)
    fast_pred = predict(topo, problem, base, ("ring", "charm"))
    slow_pred = predict(topo, problem, slow, ("ring", "charm"))
    for method in ("ring", "charm"):
        for tag in ("forward", "backward"):
            a = getattr(fast_pred.methods[method], tag)
            b = getattr(slow_pred.methods[method], tag)
            # slower, but the blocks computed with no exchange in flight are not slowed
            assert a.makespan < b.makespan
            assert b.busy_mean < 2 * a.busy_mean
    one = Topology(1, 1, 1.0, 1.0)
    alone = predict(one, Problem(1, 4096, 8, 64, causal=True), slow, ("ring",))
    ref = predict(one, Problem(1, 4096, 8, 64, causal=True), base, ("ring",))
    assert alone.methods["ring"].total == pytest.approx(ref.methods["ring"].total)
    with pytest.raises(ValueError, match="slowdowns under communication must be >= 1"):
        replace(base, fwd_slowdown=0.5)


def test_advise_says_where_its_numbers_come_from_and_how_far_to_trust_them(
    tmp_path, capsys
) -> None:
    import re

    problem = ["--seq", "8192", "--heads", "8", "--head-dim", "64", "--causal", "--json"]

    def reasons(*cluster: str) -> str:
        assert main(["advise", *cluster, *problem]) == 0
        said = json.loads(capsys.readouterr().out)["reasons"]
        return next(r for r in said if r.startswith(("uncertainty: ", "hardware numbers: ")))

    def margin_range(line: str) -> tuple[float, float, float]:
        got = re.search(r"margin over the next method ([\d.]+)x, ([\d.]+)x-([\d.]+)x", line)
        assert got, line
        return tuple(float(x) for x in got.groups())

    # each preset quotes its own GPU's worst miss of the paper's rows (Hardware.paper_error)
    err = PRESETS["H100"].paper_error
    preset = reasons("--preset", "H100", "--gpus", "2x2")
    assert "not measured on this cluster" in preset and f"+-{err:.0%}" in preset
    margin, lo, hi = margin_range(preset)
    assert lo == pytest.approx(margin * (1 - err) / (1 + err), abs=0.01)
    assert hi == pytest.approx(margin * (1 + err) / (1 - err), abs=0.01)
    l20 = reasons("--preset", "L20", "--gpus", "2x2")
    assert "L20 rows" in l20 and f"+-{PRESETS['L20'].paper_error:.0%}" in l20

    path = tmp_path / "p.json"
    raw = _raw()
    raw["kernel"][0]["fwd_s"] *= 1.5  # one sample off the line: the fit's residual is known
    prof = fit_profile(raw)
    prof.save(path)
    measured = reasons("--profile", str(path))
    err = prof.known_error
    assert 0.05 < err < 0.9 and f"up to {err:.0%}" in measured
    margin, lo, hi = margin_range(measured)
    assert lo == pytest.approx(margin * (1 - err) / (1 + err), abs=0.01)

    flags = ["--gpus", "2x2", "--intra-bw", "100", "--cross-bw", "10", "--tflops", "100"]
    assert "the flags given, not measured here" in reasons(*flags)


def test_blocks_timed_one_rank_at_a_time_record_the_shared_host() -> None:
    # Note [Ranks sharing a host]: the calibration's ranks all on one host (loopback, testbed)
    raw = _raw()
    assert fit_profile(raw).compute_model().host_slots() == 0.0
    raw.update(one_host=True, host_cores=2, threads=1)
    assert fit_profile(raw).compute_model().host_slots() == 2.0
    raw.update(threads=2)
    assert fit_profile(raw).compute_model().host_slots() == 1.0
    with pytest.raises(ValueError, match="shared_slots=-1"):
        FittedCompute(1e10, 1e10, shared_slots=-1)


def test_host_work_comes_from_the_trace_and_is_scaled_to_one_rank_alone() -> None:
    # Note [Host work of a call]: four ranks measured at once on a host of two slots
    raw = _raw()
    raw["host_work"] = {"s_local": 512, "call_s": 4e-3, "post_s": 1e-3}
    assert fit_profile(raw).compute_model().host_work() == (4e-3, 1e-3)
    raw.update(one_host=True, host_cores=2, threads=1)
    assert fit_profile(raw).compute_model().host_work() == pytest.approx((2e-3, 5e-4))
    del raw["host_work"]
    assert fit_profile(raw).compute_model().host_work() == (0.0, 0.0)


def test_host_work_measured_as_cpu_time_is_fitted_per_pass_exchange_and_byte() -> None:
    # Note [Host work of a call]: samples of a known host are fitted back, taken as they are
    # (CPU seconds need no sharing scale), preferred over the trace, and unused on a GPU. The
    # calling thread: 1 ms per pass, 0.5 ms per exchange, 1 ns per byte; the transport's
    # threads: 0.1 ms per exchange, 2 ns per byte
    raw = _raw()
    raw.update(one_host=True, host_cores=2, threads=1)
    raw["host_work"] = {"s_local": 512, "call_s": 4e-3, "post_s": 1e-3}
    shapes = [(3, 1_500_000), (7, 5_000_000), (6, 700_000), (9, 1_700_000), (9, 800_000)]
    raw["host_cpu"] = []
    for ex, nb in shapes:
        own = 1e-3 + 5e-4 * ex + 1e-9 * nb
        raw["host_cpu"].append(
            {"method": "ring", "s_local": 512, "backward": False, "exchanges": ex, "bytes": nb,
             "thread_s": own, "cpu_s": own + 1e-4 * ex + 2e-9 * nb}
        )  # fmt: skip
    prof = fit_profile(raw)
    model = prof.compute_model()
    assert model.host_work() == pytest.approx((1e-3, 5e-4), rel=1e-6)
    assert model.host_per_byte() == pytest.approx(1e-9, rel=1e-6)
    assert model.transport_work() == pytest.approx((1e-4, 2e-9), rel=1e-6)
    assert prof.fit_error["host_cpu"] == pytest.approx(0.0, abs=1e-9)
    # a sample off by 10% shows in the residual
    raw["host_cpu"][0]["cpu_s"] *= 1.1
    assert fit_profile(raw).fit_error["host_cpu"] > 0.01
    del raw["host_work"]  # a GPU's trace is enqueue work (its own test below)
    raw["device"] = "cuda"
    cuda = fit_profile(raw).compute_model()
    assert cuda.host_work() == (0.0, 0.0) and cuda.host_per_byte() == 0.0
    assert cuda.transport_work() == (0.0, 0.0)
    with pytest.raises(ValueError, match="per byte -1"):
        FittedCompute(1e10, 1e10, host_byte_s=-1.0)
    with pytest.raises(ValueError, match="transport's per exchange -1"):
        FittedCompute(1e10, 1e10, transport_post_s=-1.0)


def test_host_work_grows_with_the_elements_of_the_ranks_queries() -> None:
    # Note [Host work of a call]: the thread's work per pass grows with the rank's problem, not
    # with its bytes. A known host: 1 ms per pass, 0.5 ms per exchange, nothing per byte,
    # 10 / 30 ns per query element forward / backward; samples of three sizes and two methods
    # that send different bytes for the same elements
    raw = _raw()
    raw.update(one_host=True, host_cores=2, threads=1)
    raw["host_cpu"] = []
    for tokens in (256, 512, 1024):
        elements = tokens * 8 * 64
        for method, ex, per_token in (("ring", 3, 6000), ("charm", 6, 2500)):
            for backward in (False, True):
                own = 1e-3 + 5e-4 * ex + (30e-9 if backward else 10e-9) * elements
                raw["host_cpu"].append(
                    {"method": method, "s_local": tokens, "backward": backward,
                     "exchanges": ex, "bytes": per_token * tokens, "elements": elements,
                     "thread_s": own, "cpu_s": own + 2e-9 * per_token * tokens}
                )  # fmt: skip
    prof = fit_profile(raw)
    c = prof.compute
    assert (c["host_element_fwd_s"], c["host_element_bwd_s"]) == pytest.approx((1e-8, 3e-8))
    assert (c["host_call_s"], c["host_post_s"]) == pytest.approx((1e-3, 5e-4))
    assert c["host_byte_s"] == pytest.approx(0.0, abs=1e-15)
    assert prof.fit_error["host_cpu"] == pytest.approx(0.0, abs=1e-9)
    # the pass's share at its start: per pass plus per element of its shape
    model = prof.compute_model()
    shape = AttnShape(1, 1024, 8, 8, 64)
    assert model.host_call_time(shape, True) == pytest.approx(1e-3 + 3e-8 * 1024 * 8 * 64)
    assert model.host_call_time(shape, False) == pytest.approx(1e-3 + 1e-8 * 1024 * 8 * 64)
    # no trace of the call: all of it before the first instruction, as before it was traced
    assert (model.host_first_fwd, model.host_first_bwd) == (1.0, 1.0)
    # Note [Where a call's host work runs]: the traced time to the first instruction at 512
    # tokens (every rank at once: four ranks on two slots, so half of it alone), per direction
    # or (older raw samples) both directions' median, over what the fit charges that call
    charged = {b: 1e-3 + (3e-8 if b else 1e-8) * 512 * 8 * 64 for b in (False, True)}
    raw["host_work"] = {"s_local": 512, "call_s": 2e-3, "post_s": 1e-3, "kernel_s": 0, "merge_s": 0}
    raw["host_work"].update(call_fwd_s=2 * 0.4 * charged[False], call_bwd_s=2 * 0.1 * charged[True])
    first = fit_profile(raw).compute_model()
    assert (first.host_first_fwd, first.host_first_bwd) == pytest.approx((0.4, 0.1))
    for key in ("call_fwd_s", "call_bwd_s"):
        del raw["host_work"][key]
    mixed = fit_profile(raw).compute_model()
    assert (mixed.host_first_fwd, mixed.host_first_bwd) == pytest.approx(
        (1e-3 / charged[False], 1e-3 / charged[True])
    )
    raw["host_work"]["call_s"] = 1.0  # longer than the fit charges: all of it first
    assert fit_profile(raw).compute_model().host_first_bwd == 1.0
    raw.update(device="cuda", one_host=False)  # a GPU's trace is enqueue work
    assert fit_profile(raw).compute_model().host_first_fwd == 1.0
    raw.update(device="cpu", one_host=True)
    del raw["host_work"]
    # without the elements (older samples) the same host is fitted per byte, and misses
    for sample in raw["host_cpu"]:
        del sample["elements"]
    old = fit_profile(raw)
    assert old.compute["host_element_fwd_s"] == old.compute["host_element_bwd_s"] == 0.0
    assert old.fit_error["host_cpu"] > 0.1
    with pytest.raises(ValueError, match="per element"):
        FittedCompute(1e10, 1e10, host_element_bwd_s=-1.0)


def test_the_comparison_script_charges_host_work_from_the_trace() -> None:
    # scripts/bench/host_work_ab.py: the same profile with the old host work (traced wall
    # seconds scaled by slots over ranks, no bytes), for the results' comparison
    from tests.bench_scripts import load_bench_script

    mod = load_bench_script("host_work_ab")
    raw = _raw()
    raw.update(one_host=True, host_cores=2, threads=1)
    raw["host_work"] = {"s_local": 512, "call_s": 4e-3, "post_s": 1e-3}
    raw["host_cpu"] = [
        {"method": "ring", "s_local": 512, "backward": b, "exchanges": ex, "bytes": nb,
         "thread_s": 5e-4 * ex, "cpu_s": 5e-4 * ex + 2e-9 * nb}
        for b, ex, nb in ((False, 3, 1_500_000), (True, 7, 5_000_000), (False, 6, 700_000))
    ]  # fmt: skip
    prof = fit_profile(raw)
    assert prof.compute["transport_byte_s"] == pytest.approx(2e-9)
    as_json = {**prof.__dict__, "provenance": {"samples": {"host_work": raw["host_work"]}}}
    old = mod.refit(as_json)["compute"]
    assert (old["host_call_s"], old["host_post_s"]) == pytest.approx((2e-3, 5e-4))
    assert old["host_byte_s"] == old["transport_post_s"] == old["transport_byte_s"] == 0.0
    # the process's CPU fitted as one: bytes in the transport's threads, the rest on the stream
    as_json["provenance"]["samples"]["host_cpu"] = raw["host_cpu"]
    one = mod.refit(as_json, "process")["compute"]
    assert (one["host_call_s"], one["host_post_s"], one["host_byte_s"]) == pytest.approx(
        (0.0, 5e-4, 0.0), abs=1e-12
    )
    assert one["transport_byte_s"] == pytest.approx(2e-9) and one["transport_post_s"] == 0.0
    # samples without elements get them from the calibration's shape (kernel samples' batch
    # and head dim, the most heads timed): 512 tokens x 1 x 8 x 64, all forward here but one
    as_json["provenance"]["samples"]["kernel"] = [
        {"batch": 1, "heads": h, "head_dim": 64, "tokens": 256} for h in (1, 8)
    ]
    per_element = mod.refit(as_json, "elements")["compute"]
    assert per_element["host_post_s"] == pytest.approx(5e-4, rel=1e-6)
    assert per_element["host_element_fwd_s"] == pytest.approx(0.0, abs=1e-15)
    # and samples with elements fitted without them, per byte as before
    as_json["provenance"]["samples"]["host_cpu"] = [
        {**c, "elements": c["s_local"] * 512, "thread_s": c["thread_s"] + 1e-8 * c["s_local"] * 512}
        for c in raw["host_cpu"]
    ]
    assert mod.refit(as_json, "elements")["compute"]["host_element_fwd_s"] == pytest.approx(1e-8)
    per_byte = mod.refit(as_json, "bytes")["compute"]
    # every sample has 512 tokens: without the term, the pass's constant takes it
    assert per_byte["host_element_fwd_s"] == 0.0
    assert per_byte["host_call_s"] == pytest.approx(1e-8 * 512 * 512, rel=1e-6)
    with pytest.raises(ValueError, match="--form 'x'"):
        mod.refit(as_json, "x")


def test_a_gloo_calibration_replays_exchanges_as_gloo_runs_them(tmp_path, capsys) -> None:
    raw = _raw()
    prof = fit_profile(raw)  # backend gloo
    assert prof.exchange_order == "pair" and prof.topology(2, 2).exchange_order == "pair"
    path = tmp_path / "p.json"
    prof.save(path)
    args = ["--seq", "8192", "--heads", "8", "--head-dim", "64", "--json"]
    for links in ([], ["--cross-links", "shared", "--cross-bw", "0.01"]):  # the CLI keeps it
        assert main(["--profile", str(path), *links, *args]) == 0
        topo = json.loads(capsys.readouterr().out)["topology"]
        assert topo["exchange_order"] == "pair"
        # a flag overrides its own field only: the profile's latencies stay
        assert topo["cross_lat"] == prof.cross_lat and topo["intra_lat"] == prof.intra_lat
        assert topo["cross_bw"] == (0.01 if links else prof.cross_bw)
    raw["backend"] = "nccl"
    assert fit_profile(raw).topology(2, 2).exchange_order == "channel"


def test_a_gpu_profile_takes_the_trace_as_enqueue_work_and_keeps_it_in_json(tmp_path) -> None:
    # Note [Enqueue ahead]: on a GPU each traced instruction is its enqueue; none is host work
    from megatron_charm.sim.compute import Enqueue
    from megatron_charm.sim.profile import load_profile

    raw = _raw()
    raw["host_work"] = {
        "s_local": 512,
        "call_s": 4e-5,
        "post_s": 1e-5,
        "kernel_s": 2e-5,
        "merge_s": 3e-5,
    }
    raw["device"] = "cuda"
    prof = fit_profile(raw)
    model = prof.compute_model()
    assert model.host_work() == (0.0, 0.0)
    assert model.enqueue_cost() == Enqueue(call=4e-5, exchange=1e-5, kernel=2e-5, merge=3e-5)
    prof.save(tmp_path / "gpu.json")
    assert load_profile(tmp_path / "gpu.json").compute_model() == model
    raw["device"] = "cpu"
    cpu = fit_profile(raw).compute_model()
    assert cpu.enqueue_cost() == Enqueue() and cpu.host_work() == (4e-5, 1e-5)


def test_presets_enqueue_each_operation_and_flags_can_change_it() -> None:
    from megatron_charm.sim.cli import _resolve, build_parser
    from megatron_charm.sim.compute import Enqueue
    from megatron_charm.sim.topology import GPU_ENQUEUE

    assert load_profile("H100").compute_model().enqueue_cost() == GPU_ENQUEUE
    problem = ["--seq", "4096", "--heads", "8", "--head-dim", "64"]
    args = build_parser().parse_args(["--preset", "H100", "--efficiency", "0.3", *problem])
    assert _resolve(args)[2].enqueue_cost() == GPU_ENQUEUE
    args = build_parser().parse_args(["--preset", "H100", "--enqueue-us", "5", *problem])
    e = 5 * 1e-6
    assert _resolve(args)[2].enqueue_cost() == Enqueue(e, e, e, e)
    flags = ["--gpus", "2x2", "--intra-bw", "100", "--cross-bw", "10", "--tflops", "100"]
    assert _resolve(build_parser().parse_args([*flags, *problem]))[2].enqueue_cost() == Enqueue()


def test_unmeasured_profile_without_preset_says_so() -> None:
    """A profile neither measured nor made from a preset has no known error to quote."""
    from megatron_charm.sim.cli import uncertainty
    from megatron_charm.sim.predict import Problem, predict

    prof = replace(preset_profile("H100"), preset="", name="hand-written")
    topo = prof.topology(2, 2)
    pred = predict(topo, Problem(1, 4096, 8, 64), prof.compute_model(), ("ring", "charm"))
    line = uncertainty(pred, "charm", prof)
    assert "hand-written" in line and "not measured here" in line
    assert "H100" in uncertainty(pred, "charm", preset_profile("H100"))


def test_a_one_node_replay_widens_the_range_by_its_known_error() -> None:
    """A causal plan replayed for one node is off by up to ``SYMMETRIC_ERROR`` against its full
    replay: the advice says so, the table's note quantifies it, and the margin's range adds it
    to the preset's error; a full replay of the same problem says none of it."""
    from megatron_charm.sim.cli import format_table, uncertainty
    from megatron_charm.sim.predict import Problem, advise, predict
    from megatron_charm.sim.programs import SYMMETRIC_ERROR

    prof = preset_profile("H100")
    topo = prof.topology(4, 4)
    problem = Problem(1, 4096 * 16, 8, 64, causal=True)
    methods = ("ring", "charm", "rm+")
    one_node = predict(topo, problem, prof.compute_model(), methods, full_max_ranks=8)
    full = predict(topo, problem, prof.compute_model(), methods)
    assert not one_node.methods["charm"].exact and full.methods["charm"].exact
    assert one_node.methods["ring"].exact is False  # ring is approximate in name, exact in fact

    said = f"up to {SYMMETRIC_ERROR['charm']:.0%} for charm"
    assert any("replayed for one node" in r and said in r for r in advise(one_node).reasons)
    assert not any("replayed for one node" in r for r in advise(full).reasons)
    assert said in format_table(one_node) and said not in format_table(full)
    assert "for ring" not in format_table(one_node)  # exact: no error to quote
    got = {m: e["replay_error"] for m, e in one_node.to_dict()["methods"].items()}
    assert got == {"ring": 0.0, "charm": SYMMETRIC_ERROR["charm"], "rm+": SYMMETRIC_ERROR["rm+"]}
    assert {e["replay_error"] for e in full.to_dict()["methods"].values()} == {0.0}

    def range_of(line: str) -> float:
        lo, hi = line.rsplit(", ", 1)[1].split(" within")[0].split("-")
        return float(hi.rstrip("x")) / float(lo.rstrip("x"))

    wide, narrow = uncertainty(one_node, "charm", prof), uncertainty(full, "charm", prof)
    assert said in wide and "within both errors" in wide and "within that error" in narrow
    # (1 + e) / (1 - e) at each end: the preset's error alone, then combined with the larger
    # of charm's and its runner-up's (ring's is none)
    e = prof.preset_error
    assert range_of(narrow) == pytest.approx(((1 + e) / (1 - e)) ** 2, rel=0.02)
    runner = min(("ring", "rm+"), key=lambda m: one_node.methods[m].total)
    c = (1 + e) * (1 + max(SYMMETRIC_ERROR["charm"], SYMMETRIC_ERROR.get(runner, 0.0))) - 1
    assert range_of(wide) == pytest.approx(((1 + c) / (1 - c)) ** 2, rel=0.02)
