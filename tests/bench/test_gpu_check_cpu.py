"""``scripts/gpu_check.sh --device cpu`` at a small size, and planted bugs that its checks catch."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_charm.bench import gpu_check
from megatron_charm.kernels import torch_kernel
from megatron_charm.plan import METHODS

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--device", "cpu", "--seq", "16", "--batch", "1", "--head-dims", "64"]
SMALL += ["--dtypes", "fp32,bf16"]


@pytest.mark.gloo
@pytest.mark.heavy  # about 50 s: every check of the script, end to end (CI: make test-heavy)
def test_script_runs_on_cpu_and_writes_every_check(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), *SMALL, "--json", str(out),
         "--cp4-transports", "gloo,gloo-staged"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert report["not_implemented"] == {}
    # every check but speed (CUDA only)
    assert set(report["checks"]) == set(gpu_check.CHECKS) - {"speed"}
    rows = report["checks"]["kernel_matrix"]["rows"]
    # 2 dtypes x 3 head pairs x 1 head dim x 4 blocks, all on the torch kernel
    assert len(rows) == 24 and all(r["ok"] and r["kernel"] == "torch" for r in rows)
    assert {tuple(r["heads"]) for r in rows} == {(16, 16), (16, 4), (16, 1)}

    cp4 = report["checks"]["cp4"]["transports"]
    assert list(cp4) == ["gloo", "gloo-staged"]
    for transport in cp4.values():
        cases = {(r["split"], r["causal"], r["method"]) for r in transport["rows"]}
        default = [m for m in METHODS if m != "ring-contig"]  # tasp too: --cp-seq 24 by default
        assert cases == set(itertools.product(("2x2", "1x4"), (True, False), default))
        assert all(r["ok"] for r in transport["rows"])
        assert transport["groups_left_per_rank"] == [0] * 4  # each split's topology destroyed
    # the staging wrapper carried the exchanges (through plain host copies on CPU)
    assert min(cp4["gloo-staged"]["staged_exchanges_per_rank"]) > 0

    meg = report["checks"]["megatron"]
    assert [len(meg["model"]["local"]["attention_calls"])] == [2]  # one per layer
    losses = meg["trainer"]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert meg["trainer"]["gradients"]["missing"] == 0

    cal = report["checks"]["calibrate"]
    assert cal["ran"] and cal["auto_picks"] in METHODS and cal["forward_tflops"] > 0
    assert {"compute", "fit_error", "provenance"} <= set(cal["profile_keys"])
    assert "drift" in cal["profile"]  # the run's drift, in its description
    assert cal["host"]["cores"] == os.cpu_count() and cal["host"]["gpu"] is None

    over = report["checks"]["overlap"]["breakdown"]
    assert over["transport"] == "gloo"
    for pass_ in ("forward", "backward"):
        times = over["passes"][pass_]
        assert times["compute_ms"] > 0 and times["comm_ms"] > 0
        assert times["span_ms"] >= max(times["compute_ms"], times["comm_ms"])
    assert "skipped" in report["checks"]["overlap"]["max_connections"]


def test_the_default_methods_take_tasp_where_the_local_sequence_fits_it():
    """cp4 checks tasp by default (its summed partial gradients run nowhere else on CUDA), at
    a default --cp-seq that its chunks divide; one that does not leaves it out, and naming it
    then is refused with the rule."""
    for device, cp_seq in (("cuda", 768), ("cpu", 24)):
        args = gpu_check.parse_args(["--device", device])
        assert args.cp_seq == cp_seq
        assert args.methods.split(",") == [m for m in METHODS if m != "ring-contig"]
    args = gpu_check.parse_args(["--device", "cpu", "--cp-seq", "16"])
    assert "tasp" not in args.methods.split(",") and "charm" in args.methods.split(",")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--device", "cpu", "--cp-seq", "16", "--methods", "tasp"])
    assert gpu_check.parse_args(["--cp-seq", "18", "--methods", "tasp"]).methods == "tasp"


def test_no_cuda_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def _planted(monkeypatch, tmp_path, name, fwd=None, bwd=None):
    if fwd is not None:
        real_f = torch_kernel.cpu_forward
        monkeypatch.setattr(torch_kernel, "cpu_forward", lambda *a: fwd(*real_f(*a)))
    if bwd is not None:
        real_b = torch_kernel.cpu_backward
        monkeypatch.setattr(torch_kernel, "cpu_backward", lambda *a: bwd(*real_b(*a)))
    out = tmp_path / f"{name}.json"
    args = [*SMALL, "--dtypes", "fp32", "--heads", "16/4", "--json", str(out)]
    rc = gpu_check.main([*args, "--checks", "kernel_matrix,cp1"])
    return rc, json.loads(out.read_text())


def _failed_fields(report):
    return {f for r in report["checks"]["kernel_matrix"]["rows"] for f in r["failed"]}


def test_planted_forward_bug_fails(monkeypatch, tmp_path):
    rc, report = _planted(monkeypatch, tmp_path, "fwd", fwd=lambda o, lse: (o * 1.01, lse))
    assert rc == 1
    assert {"out", "merged_out"} <= _failed_fields(report)
    assert any(f.startswith("cp1:") for f in report["failures"])


def test_planted_lse_bug_fails(monkeypatch, tmp_path):
    rc, report = _planted(monkeypatch, tmp_path, "lse", fwd=lambda o, lse: (o, lse + 0.01))
    assert rc == 1 and "lse" in _failed_fields(report)


def test_planted_backward_bug_fails(monkeypatch, tmp_path):
    rc, report = _planted(monkeypatch, tmp_path, "bwd", bwd=lambda dq, dk, dv: (dq, dk * 1.01, dv))
    assert rc == 1
    assert _failed_fields(report) == {"dk"}


def test_planted_merge_bug_fails(monkeypatch, tmp_path):
    from megatron_charm.bench import kernel_matrix

    real = kernel_matrix.merge_partial

    def bad_merge(out, lse, out_b, lse_b):
        real(out, lse, out_b, lse_b)
        lse.add_(1e-2)

    monkeypatch.setattr(kernel_matrix, "merge_partial", bad_merge)
    out = tmp_path / "merge.json"
    rc = gpu_check.main([*SMALL, "--dtypes", "fp32", "--heads", "16/16", "--json", str(out),
                         "--checks", "kernel_matrix"])  # fmt: skip
    assert rc == 1
    assert "merged_lse" in _failed_fields(json.loads(out.read_text()))


@pytest.mark.gloo
@pytest.mark.heavy  # about 15 s: the cp4 check on 4 ranks (CI: make test-heavy)
def test_planted_merge_bug_fails_cp4(tmp_path):
    """The executor's merge of partial results scales the output by 1.01 in every rank."""
    out = tmp_path / "cp4.json"
    rc = gpu_check.main(["--device", "cpu", "--checks", "cp4", "--methods", "charm",
                         "--plant", "merge", "--json", str(out)])  # fmt: skip
    assert rc == 1
    rows = json.loads(out.read_text())["checks"]["cp4"]["transports"]["gloo"]["rows"]
    assert len(rows) == 4 and not any(r["ok"] for r in rows)
    assert all(any(f.startswith("out") for f in r["failed"]) for r in rows)


@pytest.mark.gloo
@pytest.mark.heavy  # about 15 s: the cp4 check on 4 ranks (CI: make test-heavy)
def test_planted_destroy_bug_fails_cp4(tmp_path):
    """``CPTopology.destroy`` does nothing: every rank keeps the first split's groups, and the
    check fails on that alone (the numbers are right)."""
    out = tmp_path / "cp4.json"
    rc = gpu_check.main(["--device", "cpu", "--checks", "cp4", "--methods", "charm",
                         "--plant", "destroy", "--json", str(out)])  # fmt: skip
    assert rc == 1
    report = json.loads(out.read_text())
    gloo = report["checks"]["cp4"]["transports"]["gloo"]
    assert all(r["ok"] for r in gloo["rows"])
    assert all(n > 0 for n in gloo["groups_left_per_rank"])
    assert any("still holds" in f and "CPTopology.destroy" in f for f in report["failures"])


@pytest.mark.gloo
@pytest.mark.heavy  # about 15 s: the megatron check on 4 ranks (CI: make test-heavy)
def test_planted_kernel_bug_fails_megatron(tmp_path):
    """The torch kernel's forward scales its output by 1.01 inside the model's attention."""
    out = tmp_path / "megatron.json"
    rc = gpu_check.main(["--device", "cpu", "--checks", "megatron", "--train-iters", "0",
                         "--plant", "kernel", "--json", str(out)])  # fmt: skip
    assert rc == 1
    report = json.loads(out.read_text())
    calls = report["checks"]["megatron"]["model"]["local"]["attention_calls"]
    assert calls and all("out" in c["failed"] for c in calls)
    assert report["checks"]["megatron"]["trainer"] == {"skipped": "--train-iters 0"}


def test_masked_check_passes_and_catches_a_planted_bug(monkeypatch):
    """The masked check (documents, windows, THD padding against float64) passes on CPU, and a
    dv 1% too large in the block kernel's backward fails it."""
    from megatron_charm.bench.gpu_check.masked_check import masked_check

    res, bad = masked_check(torch.device("cpu"), 32)
    assert bad == [] and len(res["rows"]) == 8 and all(r["blocks"] >= 2 for r in res["rows"])
    real_b = torch_kernel.cpu_backward

    def bad_backward(*args):
        dq, dk, dv = real_b(*args)
        return dq, dk, dv * 1.01

    monkeypatch.setattr(torch_kernel, "cpu_backward", bad_backward)
    _, bad = masked_check(torch.device("cpu"), 32)
    assert bad and all(b.startswith("masked ") for b in bad)


def test_calibrate_check_fails_on_a_bad_profile(monkeypatch):
    """The calibrate check can fail: a fit that misses its samples, and samples that do not fit
    a profile at all (a rate that is not positive), each give a failure."""
    from dataclasses import replace

    # calibrate is imported before the patch below, so that its own binding of fit_profile
    # stays the real one for the tests after this one
    import megatron_charm.sim.calibrate  # noqa: F401
    from megatron_charm.bench.gpu_check import calibrate_check as cc
    from megatron_charm.sim import profile as profiles

    good = profiles.load_profile(
        REPO / "docs" / "results" / "calibrate" / "profile-2x2-shared-100mbit.json"
    )
    assert cc._problems(good) == []
    problems = cc._problems(replace(good, fit_error={"kernel_fwd": 1.5, "cross": 0.1}))
    assert problems == ["fit of kernel_fwd misses its samples by 150% (> 100%)"]
    # a machine whose speed moved during the run is reported, not a failed fit
    assert cc._problems(replace(good, fit_error={"drift": 1.5, "cross": 0.1})) == []

    def no_fit(raw, fabric="nvlink"):
        raise ValueError("fitted rates must be > 0")

    monkeypatch.setattr(profiles, "fit_profile", no_fit)
    result, failures = cc.calibrate_check(torch.device("cpu"), None)
    assert result["ran"] and failures == [
        "the samples do not fit a profile: fitted rates must be > 0"
    ]


def test_calibrate_check_bounds_the_enqueue_cost():
    """A CUDA profile's enqueue costs must each be above 0 and below MAX_ENQUEUE_S; none
    measured (zeros) or a synchronizing one (10 ms) fails."""
    from megatron_charm.bench.gpu_check import calibrate_check as cc
    from megatron_charm.sim.compute import Enqueue

    result: dict = {}
    assert cc._enqueue_problems(Enqueue(4e-5, 2e-5, 3e-5, 5e-5), result) == []
    assert result["enqueue_us"] == {"call": 40.0, "exchange": 20.0, "kernel": 30.0, "merge": 50.0}
    assert len(cc._enqueue_problems(Enqueue(), {})) == 4
    bad = cc._enqueue_problems(Enqueue(4e-5, 2e-5, 1e-2, 5e-5), {})
    assert bad == ["enqueue of one kernel took 10000.0 us (expected above 0 and below 5000 us)"]


def test_calibrate_check_wants_the_gpu_named_in_the_host_record():
    from megatron_charm.bench.gpu_check import calibrate_check as cc

    rec = {"cpu": "x", "cores": 16, "isa": [], "torch": "2.9.0", "gpu": None}
    assert cc._host_problems(rec, on_cuda=False) == []
    assert cc._host_problems(dict(rec, gpu="NVIDIA H200"), on_cuda=True) == []
    (bad,) = cc._host_problems(rec, on_cuda=True)
    assert bad.startswith("the host record names no GPU")


def test_sync_free_reports_a_synchronizing_call_and_restores_the_mode():
    from megatron_charm.bench.gpu_check.cp4 import sync_free

    modes: list[str] = []

    def syncing() -> None:  # what torch raises for .item() under set_sync_debug_mode("error")
        if modes[-1] == "error":
            raise RuntimeError("called a synchronizing CUDA operation\n(more lines)")

    got = sync_free(syncing, modes.append)
    assert got == {"ok": False, "why": "called a synchronizing CUDA operation"}
    assert modes == ["error", "default"]
    assert sync_free(lambda: None, modes.append) == {"ok": True, "why": ""}
    assert modes[-1] == "default"
    # the modes it passes are the names torch's own setter documents (it needs CUDA to run)
    doc = torch.cuda.set_sync_debug_mode.__doc__ or ""
    assert '"error"' in doc and '"default"' in doc, doc
