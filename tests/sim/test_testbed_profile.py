"""megatron_charm.sim.testbed: a testbed profile adapted to another shape of the same testbed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_charm.sim.profile import Profile
from megatron_charm.sim.testbed import pick_profile, profile_for, profile_rates

PROFILE = Profile(
    name="measured 2x2 gloo cpu bf16",
    measured=True,
    gpus="2x2",
    intra_bw=5.0,
    cross_bw=0.0146,
    intra_lat=2e-4,
    cross_lat=0.0,
    nics_per_node=1,
    fabric="nvlink",
    compute={
        "kind": "fitted",
        "fwd_flops_per_s": 6e10,
        "bwd_flops_per_s": 7e10,
        "fwd_overhead": 0.0,
        "bwd_overhead": 3e-3,
        "mem_bw": 20.0,
    },
)


SWEEP_POINT = "2x2-shared-full-b1-s512-h4-200mbit.json"


def _result(m, p, topology="shared", rate=100e6):
    return {"config": {"topology": topology}, "layout": [m, p], "cross_bps": rate}


def test_same_shape_keeps_the_profile():
    same = profile_for(PROFILE, _result(2, 2), "100mbit")
    assert same.cross_bw == pytest.approx(PROFILE.cross_bw)
    assert same.compute == PROFILE.compute and same.nics_per_node == 1


def test_rails_and_the_rate_come_from_the_result():
    got = profile_for(PROFILE, _result(2, 2, "rails", 400e6), "100mbit")
    assert got.nics_per_node == 0  # one link per rank
    assert got.cross_bw == pytest.approx(4 * PROFILE.cross_bw)
    assert got.topology(2, 4).cross_links == "rails"
    # without the calibration's rate the profile's own link stays
    assert profile_for(PROFILE, _result(2, 2, rate=400e6)).cross_bw == PROFILE.cross_bw
    # an unshaped (loopback) result has no cross link of its testbed: the profile's sharing stays
    railed = profile_for(PROFILE, _result(2, 2, "rails", 400e6))
    assert profile_for(railed, _result(2, 2, "shared", 0.0), "100mbit").nics_per_node == 0


def test_more_ranks_on_the_host_share_its_compute():
    got = profile_for(PROFILE, _result(2, 4), "100mbit").compute
    assert got["fwd_flops_per_s"] == pytest.approx(3e10)
    assert got["bwd_overhead"] == pytest.approx(6e-3)
    assert got["mem_bw"] == pytest.approx(10.0)
    # fewer ranks than the calibration: the cores were already full, nothing changes
    assert profile_for(PROFILE, _result(1, 2), "100mbit").compute == PROFILE.compute


def test_the_testbed_replay_runs_on_its_mesh_of_node_pairs():
    # docs/testbed.md: every pair of nodes has its own links, with a profile or without
    from megatron_charm.sim.testbed import calibrate

    result = {
        "config": {"topology": "shared", "batch": 1, "seq_local": 64, "heads": 2, "head_dim": 8},
        "layout": [4, 2],
        "cross_bps": 100e6,
        "pure_compute_s": {"fwd": 0.1, "fwdbwd": 0.3},
    }
    # and its links serve transfers in the order they come (the tbf queue)
    for topo in (
        calibrate(result, profile=profile_for(PROFILE, result, "100mbit")).topo,
        calibrate(result, intra_gbps=1.0).topo,
    ):
        assert topo.cross_mesh and topo.cross_fifo


def _host_case(tmp_path: Path) -> tuple[dict, dict, Path]:
    """A committed sweep result, the host record ``here``, and a committed profile rewritten
    as calibrated on ``here`` (under ``tmp_path``)."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "results"
    result = json.loads((docs / "sweep-elements-20261204" / SWEEP_POINT).read_text())
    profile = json.loads(
        (docs / "calibrate" / "profile-2x2-shared-100mbit-elements-e.json").read_text()
    )
    here = {"cpu": "A", "cores": 2, "isa": ["avx2"], "torch": "2.13.0", "gpu": None}
    profile["provenance"]["host"] = here
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    return result, here, tmp_path / "profile.json"


def test_a_result_from_another_host_than_the_profiles_is_marked(tmp_path, capsys):
    # a profile calibrated on one machine says nothing about another's kernels (the testbed's
    # blocks ran 6 times slower once the machine reported an AVX2-only CPU): the comparison
    # says so
    from megatron_charm.sim.testbed import main

    result, here, profile = _host_case(tmp_path)
    paths = []
    for name, rec in (
        ("same", here),
        ("other", dict(here, isa=["avx2", "avx512_bf16"])),
        ("old", None),
    ):
        res = dict(result, host=rec) if rec else result
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(res))
    args = [*map(str, paths), "--profile", str(profile), "--profile-rate", "100mbit"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 of the results on the profile's, 1 on another, 1 not recorded" in out
    assert out.count("Measured on another host than the profile's") == 1
    assert "(isa: ['avx2', 'avx512_bf16'] vs ['avx2'])" in out
    assert "calibration says" not in out  # a profile calibrated on a steady machine
    # one whose runs predicted 21% apart: the header says so (Note [Repeated calibrations])
    moved = json.loads(profile.read_text())
    moved["fit_error"]["repeat"] = 0.21
    profile.write_text(json.dumps(moved))
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "The calibration of 2x2 says: the runs' own profiles predict up to 21% apart" in out


def test_runs_of_one_point_from_another_host_are_marked_once(tmp_path, capsys):
    from megatron_charm.sim.testbed import main

    result, here, profile = _host_case(tmp_path)
    other = dict(here, cores=4)
    paths = []
    for folder, host in (("a", other), ("b", other), ("c", here)):
        (tmp_path / folder).mkdir()
        paths.append(tmp_path / folder / SWEEP_POINT)
        paths[-1].write_text(json.dumps(dict(result, host=host)))
    assert main([*map(str, paths), "--profile", str(profile), "--profile-rate", "100mbit"]) == 0
    out = capsys.readouterr().out
    assert "1 of the results on the profile's, 2 on another" in out
    # one warning for the point, counting its runs, its differences named once
    assert out.count("Measured on another host than the profile's") == 1
    assert "(2 of 3 runs; cores: 4 vs 2)" in out


def test_each_result_takes_the_profile_of_its_rank_count() -> None:
    # Note [A profile per rank count]: the first of the same count, else of the nearest
    four, eight = PROFILE, replace(PROFILE, gpus="2x4")
    profiles = [eight, four, replace(PROFILE, gpus="4x2")]
    picks = {(m, p): pick_profile(profiles, _result(m, p)) for m, p in ((2, 2), (2, 4), (4, 2))}
    assert picks == {(2, 2): 1, (2, 4): 0, (4, 2): 0}
    assert pick_profile(profiles, _result(1, 2)) == 1  # two ranks: four is nearest
    assert pick_profile(profiles, _result(4, 4)) == 0
    assert pick_profile([four, eight], _result(2, 3)) == 0  # a tie: the first given
    assert profile_rates(2, []) == [None, None]
    assert profile_rates(2, ["100mbit"]) == ["100mbit", "100mbit"]
    assert profile_rates(2, ["100mbit", "1gbit"]) == ["100mbit", "1gbit"]
    with pytest.raises(ValueError, match="3 --profile-rate for 2 --profile"):
        profile_rates(2, ["1mbit", "2mbit", "3mbit"])
    with pytest.raises(ValueError, match="pass --profile too"):
        profile_rates(0, ["100mbit"])


def test_a_sweep_on_two_profiles_predicts_each_point_on_its_own(tmp_path, capsys):
    from megatron_charm.sim.testbed import main

    docs = Path(__file__).resolve().parents[2] / "docs" / "results"
    four = docs / "sweep-xeon-20261206-c" / "2x2-shared-full-b1-s512-h4-200mbit.json"
    eight = docs / "sweep-xeon-20261206-c" / "2x4-rails-full-b1-s512-h4-100mbit.json"
    prof = json.loads((docs / "calibrate" / "profile-2x2-shared-1gbit-xeon-d.json").read_text())
    slow = dict(prof, gpus="2x4", compute=dict(prof["compute"], host_post_s=0.05))
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    (tmp_path / "four.json").write_text(json.dumps(prof))

    def tables(*profiles: str) -> dict[str, str]:
        args = [str(four), str(eight), "--profile-rate", "1gbit"]
        for p in profiles:
            args += ["--profile", str(tmp_path / p)]
        assert main(args) == 0
        parts = capsys.readouterr().out.split("### ")[1:]
        return {part.split()[0]: part.split("auto picks")[0] for part in parts}

    def table(part: str) -> str:
        return part.split("\n\nProfile:")[0].strip()

    alone, both = tables("four.json"), tables("slow.json", "four.json")
    assert table(both[four.name]) == table(alone[four.name])  # on the 2x2 profile, as alone
    assert "Profile: measured 2x2 gloo cpu bf16 (2x2)" in both[four.name]
    assert "Profile: measured 2x2 gloo cpu bf16 (2x4)" in both[eight.name]

    def predicted_ms(part: str) -> list[float]:
        rows = [line.split("|") for line in part.splitlines() if line.startswith("| ")]
        return [float(r[4]) for r in rows if r[2].strip() in ("fwd", "fwdbwd")]

    slower, before = predicted_ms(both[eight.name]), predicted_ms(alone[eight.name])
    assert len(slower) == len(before) >= 8
    assert all(s > b for s, b in zip(slower, before, strict=True))  # 50 ms per exchange
