"""``megatron-charm-sim calibrate`` on real gloo ranks: a loadable, usable profile comes out."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from megatron_charm.auto import choose_method
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Layout
from megatron_charm.sim.profile import load_profile


@pytest.mark.gloo
@pytest.mark.heavy  # about 25 s: a whole calibration on 4 ranks (CI: make test-heavy)
def test_calibrate_on_loopback_ranks_writes_a_profile(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "megatron_charm.sim", "calibrate", "--launcher", "loopback"]
    cmd += ["--nodes", "2", "--ranks-per-node", "2", "--tokens", "64,128", "--heads", "2"]
    cmd += ["--head-dim", "16", "--sizes", "4096,65536", "--reps", "2", "--out", str(out)]
    cmd += ["--in-pass-rounds", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cross links per node" in done.stdout
    prof = load_profile(str(out))
    assert prof.measured and prof.gpus == "2x2"
    want = {"kernel_fwd", "kernel_bwd", "intra", "cross", "host_cpu", "blocks_in_pass", "drift"}
    # with the transport's factor (Note [Transport in a pass]) unless it came out exactly 1
    assert set(prof.fit_error) - {"transport_in_pass"} == want
    assert ("transport_in_pass" in prof.fit_error) == (prof.compute["transport_in_pass"] != 1)
    assert prof.provenance["command"].startswith("megatron-charm-sim calibrate --launcher")
    assert prof.provenance["host"]["cores"] == os.cpu_count()  # the machine it describes
    samples = prof.provenance["samples"]
    # every size at the configured heads and at one head (Note [Block shapes])
    shapes = [(k["heads"], k["tokens"]) for k in samples["kernel"]]
    assert shapes == [(1, 64), (1, 128), (2, 64), (2, 128)]
    assert [s["bytes"] for s in samples["p2p"]["cross"]] == [4096, 65536]
    assert samples["concurrent_cross"]["flows"] == 2
    # and at the smallest size: where the fixed cost sits (Note [Fitting a profile])
    small = samples["concurrent_cross"]["small"]
    assert small["flows"] == 2 and small["bytes"] == 4096 and small["s"] > 0
    assert all(k["fwd_s"] > 0 and k["bwd_s"] > 0 for k in samples["kernel"])
    # the largest block timed again at the run's end (Note [A calibration's drift])
    again = samples["kernel_again"]
    assert (again["tokens"], again["heads"]) == (128, 2) and min(again["fwd_s"], again["bwd_s"]) > 0
    # the ranks took turns on this host: each rank's timing kept, their median counts
    for k in samples["kernel"]:
        for name in ("fwd", "bwd", "fwd_masked", "bwd_masked"):
            assert len(k[f"{name}_ranks_s"]) == 4
            assert k[f"{name}_s"] == pytest.approx(statistics.median(k[f"{name}_ranks_s"]))
    # masked blocks timed next to unmasked ones (Note [Masked blocks])
    assert all(k["fwd_masked_s"] > 0 and k["bwd_masked_s"] > 0 for k in samples["kernel"])
    assert [t for t, _, _ in prof.compute_model().masked_cost] == [64, 128]
    compute = prof.compute_model()
    assert compute.fwd_flops_per_s > 0 and prof.cross_bw > 0
    # every rank on this host: blocks timed one rank at a time, the host's cores recorded
    assert samples["one_host"] and compute.host_slots() == samples["host_cores"] >= 1
    # and the host work of whole calls, from the attention's own trace
    assert samples["host_work"]["call_s"] > 0 and samples["host_work"]["post_s"] > 0
    # per pass direction, whose share of the call's work runs first (Note [Where a call's
    # host work runs])
    assert min(samples["host_work"]["call_fwd_s"], samples["host_work"]["call_bwd_s"]) > 0
    assert 0 < compute.host_first_fwd <= 1 and 0 < compute.host_first_bwd <= 1
    # and the CPU time of whole calls outside kernels, per method, size and pass
    cpu = samples["host_cpu"]
    # (a2a needs the heads to divide over the 4 ranks; here they do not)
    assert {(c["method"], c["s_local"]) for c in cpu} == {
        (m, t) for m in ("ring", "charm") for t in (256, 512, 1024)
    }
    assert all(c["cpu_s"] >= c["thread_s"] > 0 for c in cpu)
    assert all(c["exchanges"] > 0 and c["bytes"] > 0 for c in cpu)
    assert [c["elements"] for c in cpu] == [c["s_local"] * 2 * 16 for c in cpu]  # b 1, 2 x 16
    # and the kernel's CPU inside whole passes, per method and pass (Note [Blocks in a pass])
    passes = samples["blocks_in_passes"]
    assert {(c["method"], c["backward"]) for c in passes} == {
        (m, b) for m in ("ring", "charm") for b in (False, True)
    }
    assert all(c["s_local"] == 512 and c["cpu_s"] > 0 for c in passes)
    # in rounds, their median counting: two here
    assert all(len(c["rounds"]) == 2 and min(c["rounds"]) > 0 for c in passes)
    assert all(c["cpu_s"] == pytest.approx(sum(c["rounds"]) / 2) for c in passes)
    assert compute.fwd_in_pass > 0 and compute.bwd_in_pass > 0
    # and in the same passes the calling thread's and the process's CPU (Note [Transport in a
    # pass]): the kernel runs on the thread, the thread in the process
    assert all(c["process_s"] >= c["thread_s"] >= c["cpu_s"] for c in passes)
    assert compute.transport_in_pass > 0
    host = (*compute.host_work(), compute.host_per_byte(), *compute.transport_work())
    assert min(host) >= 0 and sum(host[1:]) > 0
    choice = choose_method(prof, Layout(2, 2), AttnShape(1, 1024, 8, 8, 64, 2), True)
    assert choice.method in choice.predicted_s


@pytest.mark.gloo
@pytest.mark.heavy  # about 30 s: a whole calibration on 8 ranks (CI: make test-heavy)
def test_calibrate_times_concurrent_intra_pairs_on_four_ranks_per_node(tmp_path):
    # Note [Fitting a profile]: with --fabric pcie and four ranks per node, two disjoint pairs
    # ping-pong at once; the profile keeps the timing and reads a shared domain from it (or none).
    # Calibrated twice in a row (--repeat 2): the median run kept, of two the faster (Note
    # [Repeated calibrations]), the spread of the runs' own fits joins the known error.
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "megatron_charm.sim", "calibrate", "--launcher", "loopback"]
    cmd += ["--nodes", "1", "--ranks-per-node", "4", "--tokens", "64", "--heads", "2"]
    cmd += ["--head-dim", "16", "--sizes", "4096,262144", "--reps", "2", "--fabric", "pcie"]
    cmd += ["--repeat", "2", "--raw", str(tmp_path / "raw.json")]
    done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    prof = load_profile(str(out))
    runs = prof.provenance["repeats"]
    assert len(runs) == 2 and prof.provenance["combine"] == "median-run"
    assert [r["kept"] for r in runs].count(True) == 1
    kept = next(r for r in runs if r["kept"])
    assert kept["block_fwd_s"] == min(r["block_fwd_s"] for r in runs)  # of two, the faster
    # the spread is the runs' predictions' (ring and charm, forward and backward)
    want = {f"{m} {t}" for m in ("ring", "charm") for t in ("fwd", "bwd")}
    assert all(set(r["predicted_s"]) == want for r in runs)
    assert all(0 < t < math.inf for r in runs for t in r["predicted_s"].values())
    # the spread joins the other fit residuals (one node: no cross link), all finite, and bounds
    # the known error from below
    assert set(prof.fit_error) - {"transport_in_pass"} == {
        "kernel_fwd",
        "kernel_bwd",
        "intra",
        "host_cpu",
        "blocks_in_pass",
        "drift",
        "repeat",
    }
    assert all(0 <= e < math.inf for e in prof.fit_error.values())
    assert prof.known_error >= prof.fit_error["repeat"]
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert len(raw["repeats"]) == 1  # --raw keeps every run
    # --from-raw fits the same samples again without measuring: the same profile; with
    # --combine pool the median of every timing (of two, their mean)
    from megatron_charm.sim.cli import main

    refit = tmp_path / "refit.json"
    cmd = ["calibrate", "--from-raw", str(tmp_path / "raw.json"), "--fabric", "pcie"]
    assert main([*cmd, "--out", str(refit)]) == 0
    again = load_profile(str(refit))
    assert again.compute == prof.compute and again.fit_error == prof.fit_error
    assert again.provenance["command"] == prof.provenance["command"]
    assert again.provenance["refit"].startswith("megatron-charm-sim calibrate --from-raw")
    assert again.provenance["date"] == prof.provenance["date"] != "not recorded"
    assert main([*cmd, "--combine", "pool", "--out", str(refit)]) == 0
    pooled = load_profile(str(refit))
    assert pooled.provenance["combine"] == "pool"
    assert all("kept" not in r for r in pooled.provenance["repeats"])
    largest = max(pooled.provenance["samples"]["kernel"], key=lambda k: (k["tokens"], k["heads"]))
    assert largest["fwd_s"] == pytest.approx(sum(r["block_fwd_s"] for r in runs) / 2)
    # --run K: the K-th run fitted alone, with the raw file's labels
    assert main([*cmd, "--run", "2", "--out", str(refit)]) == 0
    second = load_profile(str(refit))
    assert (
        "repeats" not in second.provenance and second.provenance["date"] == again.provenance["date"]
    )
    block = max(second.provenance["samples"]["kernel"], key=lambda k: (k["tokens"], k["heads"]))
    assert block["fwd_s"] == runs[1]["block_fwd_s"]
    assert main([*cmd, "--run", "3", "--out", str(refit)]) == 2
    conc = prof.provenance["samples"]["concurrent_intra"]
    assert conc["flows"] == 2 and conc["bytes"] == 262144 and conc["s"] > 0
    # The formula has its own unit test (test_profile.py); here only what must hold of any
    # timing: no domain, or a shared one slower than the two pairs at one pair's full rate.
    assert prof.fabric == "pcie" and prof.pcie_domain >= 0
    assert prof.pcie_domain == 0 or prof.pcie_domain < 2 * prof.intra_bw
    assert ("PCIe domain" in done.stdout) == (prof.pcie_domain > 0)


def test_calibrate_refuses_bad_sizes(capsys):
    from megatron_charm.sim.cli import main

    assert main(["calibrate", "--out", "x.json", "--tokens", "0,64"]) == 2
    assert "--tokens '0,64' must be a comma-separated list of positive integers" in (
        capsys.readouterr().err
    )
    assert main(["calibrate", "--out", "x.json", "--repeat", "0"]) == 2
    assert "--repeat 0 must be >= 1" in capsys.readouterr().err
    assert main(["calibrate", "--out", "x.json", "--in-pass-rounds", "0"]) == 2
    assert "--in-pass-rounds 0 must be >= 1" in capsys.readouterr().err
    assert main(["calibrate", "--out", "x.json", "--from-raw", "no-such-raw.json"]) == 2
    assert "--from-raw no-such-raw.json: cannot read it" in capsys.readouterr().err
    assert main(["calibrate", "--out", "x.json", "--run", "1"]) == 2
    assert "--run 1 picks a run of a raw file: pass --from-raw" in capsys.readouterr().err


def test_a_run_of_exchanges_shares_its_host_time_equally():
    # Note [Receives of a run first]: gloo posts a run with its last exchange, so that event
    # holds the run's posting and the others only their staging
    from megatron_charm.sim.calibrate_worker import _per_exchange

    events = [
        ("Exchange", "intra", 0.0, 0.001),
        ("Exchange", "cross", 0.001, 0.0011),
        ("Exchange", "intra", 0.0011, 0.004),
        ("Compute", "", 0.004, 0.009),
        ("Exchange", "cross", 0.009, 0.011),
        ("Wait", "cross", 0.011, 0.012),
        ("Exchange", "intra", 0.012, 0.016),
    ]
    got = _per_exchange(events)
    assert got == pytest.approx([0.004 / 3] * 3 + [0.002, 0.004])
