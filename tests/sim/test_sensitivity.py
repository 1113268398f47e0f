"""Note [Enqueue sensitivity]: the host's enqueue time per pass, and advise's note where an
assumed enqueue cost decides the margin."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_charm.sim import FlopsCompute, Problem, Topology, predict
from megatron_charm.sim.cli import main
from megatron_charm.sim.compute import Enqueue
from megatron_charm.sim.sensitivity import (
    NCCL_INTRA_LAT,
    enqueue_note,
    host_share,
    intra_lat_note,
)

TOPO = Topology(1, 2, 100.0, 10.0)
# call, exchange, kernel, merge: distinct powers of ten, so a count of each shows in the sum
ENQ = Enqueue(call=1e-6, exchange=10e-6, kernel=100e-6, merge=1000e-6)


def test_the_host_enqueue_time_counts_each_operation_of_the_pass() -> None:
    compute = FlopsCompute(100.0, 0.5, mem_bw=1e6, enqueue=ENQ)
    pred = predict(TOPO, Problem(1, 1024, 2, 64), compute, ("ring",))
    ring = pred.methods["ring"]
    # ring on two ranks (plan.render --method ring --nodes 1 --ranks-per-node 2 --non-causal):
    # forward: 1 exchange, 2 kernel calls; backward: 3 exchanges, 2 kernel calls, 2 merges
    assert ring.forward.enqueued_max == pytest.approx(1e-6 + 10e-6 + 200e-6)
    assert ring.backward.enqueued_max == pytest.approx(1e-6 + 30e-6 + 200e-6 + 2000e-6)
    no_host = predict(TOPO, Problem(1, 1024, 2, 64), FlopsCompute(100.0, 0.5), ("ring",))
    assert no_host.methods["ring"].forward.enqueued_max == 0.0


def _small_and_large(enqueue: Enqueue | None):
    compute = FlopsCompute(100.0, 0.5, mem_bw=1e6, enqueue=enqueue)
    topo = Topology(2, 2, 100.0, 10.0)
    small = predict(topo, Problem(1, 256, 2, 64), compute, ("ring", "charm"))
    large = predict(topo, Problem(8, 65536, 16, 128), compute, ("ring", "charm"))
    return topo, compute, small, large


def test_the_note_replays_the_two_leaders_without_and_with_twice_the_enqueue_cost() -> None:
    e = 20e-6
    topo, compute, small, large = _small_and_large(Enqueue(e, e, e, e))
    seen: list[tuple[float, tuple[str, ...]]] = []

    def replay(model, names):
        seen.append((model.enqueue_cost().kernel, names))
        return predict(topo, small.problem, model, names)

    choice = min(small.methods, key=lambda m: small.methods[m].total)
    assert max(host_share(mp) for mp in small.methods.values()) > 0.5  # host-bound
    note = enqueue_note(small, choice, compute, replay)
    assert note is not None and note.startswith("host: enqueueing takes the host ")
    assert "at 20 us per operation (assumed" in note and "at 0 us " in note and "at 40 us " in note
    assert [k for k, _ in seen] == pytest.approx([0.0, 40e-6])
    assert all(sorted(names) == ["charm", "ring"] for _, names in seen)
    # where blocks and links take the time, the host's enqueueing is a sliver: no note
    assert max(host_share(mp) for mp in large.methods.values()) < 0.01
    assert enqueue_note(large, "charm", compute, replay) is None


def test_no_note_without_an_enqueue_cost() -> None:
    _, compute, small, _ = _small_and_large(None)
    assert enqueue_note(small, "charm", compute, lambda *a: pytest.fail("replayed")) is None


#: ``advise`` on the Notes' example: 2 x 8 H100, 12 heads of 192.
H100_2X8 = "advise --preset H100 --gpus 2x8 --heads 12 --head-dim 192 --json".split()


def _h100_advice(capsys: pytest.CaptureFixture[str], extra: str, prefix: str) -> list[str]:
    """The reasons of ``advise`` on :data:`H100_2X8` plus ``extra`` that start with ``prefix``."""
    assert main([*H100_2X8, *extra.split()]) == 0
    reasons = json.loads(capsys.readouterr().out)["reasons"]
    return [r for r in reasons if r.startswith(prefix)]


def test_advise_adds_the_note_only_to_a_presets_assumed_cost(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the Note's example: 2 x 8 H100, 12 heads of 192; at batch 1 and 3,360 tokens the enqueue
    # cost decides between charm and ring
    def host_reasons(extra: str) -> list[str]:
        return _h100_advice(capsys, extra, "host: ")

    small = host_reasons("--batch 1 --seq 3360")
    assert len(small) == 1 and "20 us per operation (assumed" in small[0]
    assert host_reasons("--batch 1 --seq 3360 --enqueue-us 20") == []  # the user's own number
    assert host_reasons("--batch 16 --seq 26880") == []


def test_scaled_enqueue_keeps_each_kind() -> None:
    assert dataclasses.astuple(ENQ.times(2.0)) == pytest.approx((2e-6, 20e-6, 200e-6, 2000e-6))
    assert Enqueue.per_operation(3e-6) == Enqueue(3e-6, 3e-6, 3e-6, 3e-6)


def test_auto_logs_where_a_presets_assumed_host_cost_decides(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_charm import auto
    from megatron_charm.auto import choose_method
    from megatron_charm.plan.payloads import AttnShape
    from megatron_charm.plan.types import Layout

    monkeypatch.setattr(auto, "_CACHE", {})  # a cached choice is not logged again

    layout = Layout(2, 8)  # the Note's example: 3,360 tokens over 16 ranks
    with caplog.at_level("WARNING", logger="megatron_charm"):
        small = choose_method("H100", layout, AttnShape(1, 210, 12, 12, 192, 2), causal=False)
    assert small.reasons[-2].startswith("host: enqueueing takes the host ")
    assert small.reasons[-1].startswith("links: the preset's 40 us per intra-node transfer")
    for kind in ("host: ", "links: "):
        assert any("cp method auto -> " in r.message and kind in r.message for r in caplog.records)
    large = choose_method("H100", layout, AttnShape(16, 1680, 12, 12, 192, 2), causal=False)
    assert not any(r.startswith(("host: ", "links: ")) for r in large.reasons)


def test_only_a_presets_enqueue_cost_counts_as_assumed() -> None:
    from megatron_charm.sim.profile import preset_profile
    from megatron_charm.sim.sensitivity import assumes_preset_costs

    preset = preset_profile("H100")
    assert assumes_preset_costs(preset)
    assert not assumes_preset_costs(dataclasses.replace(preset, measured=True))
    assert not assumes_preset_costs(dataclasses.replace(preset, preset=""))
    assert not assumes_preset_costs(None)


def test_the_note_needs_a_margin_moved_out_of_the_quoted_error() -> None:
    e = 20e-6
    _, compute, small, _ = _small_and_large(Enqueue(e, e, e, e))
    choice = min(small.methods, key=lambda m: small.methods[m].total)
    other = next(m for m in small.methods if m != choice)
    assert max(host_share(mp) for mp in small.methods.values()) > 0.5  # host-bound
    # replays that move the runner-up's time, and so the margin, by 5%
    moved = dataclasses.replace(small, methods=dict(small.methods))
    mp = small.methods[other]
    slower = [dataclasses.replace(p, makespan=p.makespan * 1.05) for p in (mp.forward, mp.backward)]
    moved.methods[other] = dataclasses.replace(mp, forward=slower[0], backward=slower[1])
    # inside a +-10% error the range is [margin / 1.22, margin * 1.22]: no note
    assert enqueue_note(small, choice, compute, lambda *a: moved, error=0.1) is None
    # inside +-1% it is [margin / 1.02, margin * 1.02]: 5% is out of it
    note = enqueue_note(small, choice, compute, lambda *a: moved, error=0.01)
    assert note is not None and note.startswith("host: ")
    # an unmoved margin never calls for a note
    assert enqueue_note(small, choice, compute, lambda *a: small, error=0.0) is None


def test_advise_adds_the_links_note_only_to_a_presets_intra_node_cost(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # H100's 40 us per NVLink transfer (Note [H100's NVLink fixed cost]) decides charm's margin
    # over ring at batch 1 and 3,360 tokens: 1.74x, 1.28x at 80 us, out of the +-9% range
    def links_reasons(extra: str) -> list[str]:
        return _h100_advice(capsys, extra, "links: ")

    small = links_reasons("--batch 1 --seq 3360")
    assert len(small) == 1 and "the preset's 40 us per intra-node transfer" in small[0]
    assert "at 5 us charm leads ring" in small[0] and "at 80 us " in small[0]
    assert links_reasons("--batch 1 --seq 3360 --intra-lat-us 40") == []  # the user's own
    assert links_reasons("--batch 16 --seq 26880") == []
    # predict's JSON carries it too
    assert main(["predict", *H100_2X8[1:], "--batch", "1", "--seq", "3360"]) == 0
    assert json.loads(capsys.readouterr().out)["links_note"].startswith("links: ")


def test_the_links_note_replays_at_nccls_cost_and_twice_the_presets() -> None:
    e = 20e-6
    _, compute, small, _ = _small_and_large(Enqueue(e, e, e, e))
    topo = Topology(2, 2, 100.0, 10.0, intra_lat=40e-6)
    choice = min(small.methods, key=lambda m: small.methods[m].total)
    other = next(m for m in small.methods if m != choice)
    moved = dataclasses.replace(small, methods=dict(small.methods))
    mp = small.methods[other]
    slower = [dataclasses.replace(p, makespan=p.makespan * 1.05) for p in (mp.forward, mp.backward)]
    moved.methods[other] = dataclasses.replace(mp, forward=slower[0], backward=slower[1])
    seen: list[tuple[float, tuple[str, ...]]] = []

    def replay(links, names):
        seen.append((links.intra_lat, names))
        return moved

    note = intra_lat_note(small, choice, topo, replay, error=0.01)
    assert note is not None and note.startswith("links: the preset's 40 us per intra-node")
    assert [lat for lat, _ in seen] == pytest.approx([NCCL_INTRA_LAT, 80e-6])
    assert all(sorted(names) == sorted((choice, other)) for _, names in seen)
    # within the quoted error, or an unmoved margin: no note
    assert intra_lat_note(small, choice, topo, lambda *a: moved, error=0.1) is None
    assert intra_lat_note(small, choice, topo, lambda *a: small) is None
    # at NCCL's own cost there is nothing to replay
    nccl = dataclasses.replace(topo, intra_lat=NCCL_INTRA_LAT)
    assert intra_lat_note(small, choice, nccl, lambda *a: pytest.fail("replayed")) is None


def test_a_fit_is_scaled_where_it_prices() -> None:
    # Note [What a fit's error moves]: a block fit scales its blocks, a link fit its links
    from megatron_charm.plan.types import Compute, Part
    from megatron_charm.sim.compute import FittedCompute
    from megatron_charm.sim.sensitivity import scaled_fit

    fitted = FittedCompute(1e11, 2e11, fwd_overhead=1e-4, fwd_per_element=1e-9, host_post_s=1e-3)
    topo = Topology(2, 2, 4.0, 0.01, intra_lat=1e-4, cross_lat=2e-4)
    shape = Problem(1, 4096, 8, 64).shape(4)
    block = Compute(0, 0, Part.FULL, Part.FULL, False)
    compute, same = scaled_fit("kernel_fwd", 2.0, fitted, topo)
    assert same is topo
    assert compute.block_time(block, shape, False) == pytest.approx(
        2 * fitted.block_time(block, shape, False), rel=1e-12
    )
    assert compute.block_time(block, shape, True) == fitted.block_time(block, shape, True)
    # the factor of blocks in a pass scales both directions' blocks
    in_pass, _ = scaled_fit("blocks_in_pass", 1.5, fitted, topo)
    for backward in (False, True):
        assert in_pass.block_time(block, shape, backward) == pytest.approx(
            1.5 * fitted.block_time(block, shape, backward), rel=1e-12
        )
    # so does the host's speed moving during the calibration (Note [A calibration's drift])
    drift, _ = scaled_fit("drift", 1.2, fitted, topo)
    for backward in (False, True):
        assert drift.block_time(block, shape, backward) == pytest.approx(
            1.2 * fitted.block_time(block, shape, backward), rel=1e-12
        )
    host, _ = scaled_fit("host_cpu", 2.0, fitted, topo)
    assert host.host_work() == pytest.approx((0.0, 2e-3))
    kept, links = scaled_fit("cross", 2.0, fitted, topo)
    assert kept is fitted
    assert (links.cross_bw, links.cross_lat) == pytest.approx((0.005, 4e-4))
    assert (links.intra_bw, links.intra_lat) == (4.0, 1e-4)
    # what it cannot scale: a calibration's spread, and a compute model without the fields
    assert scaled_fit("repeat", 2.0, fitted, topo) is None
    assert scaled_fit("kernel_fwd", 2.0, FlopsCompute(100.0, 0.5), topo) is None


def test_the_fits_note_moves_both_leaders_together() -> None:
    # each fit replayed at its own miss, up and down: a fit that prices both leaders alike
    # leaves their margin where it is, far inside the range that widens each time by itself
    from megatron_charm.sim.compute import FittedCompute
    from megatron_charm.sim.predict import margin_range
    from megatron_charm.sim.sensitivity import fits_note

    compute = FittedCompute(1e11, 2e11, fwd_overhead=1e-4, host_post_s=1e-4)
    topo = Topology(2, 2, 4.0, 0.01, intra_lat=1e-4, cross_lat=2e-4)
    problem = Problem(1, 4096, 4, 64, causal=True)
    pred = predict(topo, problem, compute, ("ring", "charm", "a2a"))
    choice = min(("charm", "a2a"), key=lambda m: pred.methods[m].total)
    seen = []

    def replay(model, names, links):
        seen.append(names)
        return predict(links, problem, model, names)

    errors = {"kernel_fwd": 0.5, "cross": 0.5, "repeat": 0.5}
    note = fits_note(pred, choice, compute, topo, replay, errors, ("charm", "a2a"))
    assert note is not None and note.startswith("fits: each fit replayed at its own worst miss")
    assert "kernel_fwd 50%, cross 50%" not in note and "cross 50%, kernel_fwd 50%" in note
    assert "repeat" not in note  # a spread it cannot scale is left to the wider range
    assert len(seen) == 4 and all(sorted(n) == ["a2a", "charm"] for n in seen)
    other = "a2a" if choice == "charm" else "charm"
    margin = pred.methods[other].total / pred.methods[choice].total
    lo, hi = (float(x) for x in note.split("stays within ")[1].split(" ")[0][:-1].split("x-"))
    wide = margin_range(margin, 0.5)
    assert wide[0] < lo <= round(margin, 2) <= hi < wide[1]
    assert hi / lo > 1.001  # the cross link prices charm and a2a differently
    # nothing to compare, or nothing it can scale: no note
    assert fits_note(pred, choice, compute, topo, replay, errors, (choice,)) is None
    assert fits_note(pred, choice, compute, topo, replay, {"repeat": 0.5}) is None


def test_advise_and_predict_add_the_fits_note_for_a_measured_profile(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_charm.sim.profile import preset_profile

    prof = dataclasses.replace(
        preset_profile("H100"),
        measured=True,
        preset="",
        name="measured here",
        fit_error={"kernel_fwd": 0.1, "kernel_bwd": 0.1, "intra": 0.3, "cross": 0.05},
    )
    path = tmp_path / "p.json"
    prof.save(path)
    problem = ["--gpus", "2x4", "--seq", "16384", "--heads", "8", "--head-dim", "64"]
    assert main(["advise", "--profile", str(path), *problem, "--json"]) == 0
    reasons = json.loads(capsys.readouterr().out)["reasons"]
    assert sum(r.startswith("fits: ") for r in reasons) == 1
    assert main(["predict", "--profile", str(path), *problem, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits_note"].startswith("fits: ")
    # a preset's error is its rows' miss, not a fit's: no fits note
    assert main(["advise", "--preset", "H100", *problem, "--json"]) == 0
    assert not any(r.startswith("fits: ") for r in json.loads(capsys.readouterr().out)["reasons"])
