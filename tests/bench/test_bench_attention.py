"""The attention benchmark end to end on 2 x 1 at a tiny size, and its byte accounting.

Runs on the emulated testbed when it is usable (root, ``ip netns``), else on local loopback.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_charm.bench.__main__ import main
from megatron_charm.bench.accounting import method_bytes
from megatron_charm.bench.provenance import host
from megatron_charm.plan import Layout, PlanOptions, build_plan
from megatron_charm.plan.cost import plan_bytes
from megatron_charm.plan.payloads import AttnShape


def _launcher() -> str:
    from megatron_charm.testbed import TestbedError
    from megatron_charm.testbed.net import check_prerequisites

    try:
        check_prerequisites()
    except (TestbedError, OSError):
        return "loopback"
    return "testbed"


@pytest.mark.parametrize("method", ["charm", "rm+", "merge", "ring", "all_gather"])
@pytest.mark.parametrize("causal", [True, False])
def test_link_classes_add_up_to_plan_bytes(method, causal):
    # Classifying sends by peer node must neither lose nor invent bytes.
    shape = AttnShape(2, 64, 4, 2, 16)
    layout = Layout(2, 4)
    got = method_bytes(method, layout, causal, shape, "rails")
    fwd, bwd = plan_bytes(build_plan(PlanOptions(method=method), layout, causal, shape), shape)
    for name, ref in (("fwd", fwd), ("bwd", bwd)):
        total = sum(b for per in ref.values() for b in per.values())
        assert got[name].intra + got[name].cross == total
    if method == "charm":
        # CHARM+ sends across nodes only on its cross channels.
        cross = sum(v for per in fwd.values() for ch, v in per.items() if ch.startswith("cross."))
        assert got["fwd"].cross == cross


def test_attention_benchmark_2x1(tmp_path):
    out = tmp_path / "res.json"
    main(
        [
            "attention",
            "--launcher", _launcher(),
            "--nodes", "2", "--ranks-per-node", "1", "--cross-rate", "1gbit",
            "--seq-local", "64", "--heads", "2", "--head-dim", "16", "--batch", "1",
            "--iters", "2", "--warmup", "0", "--reference", "--quiet",
            "--timeout", "50",
            "--json", str(out),
        ]
    )  # fmt: skip
    res = json.loads(out.read_text())
    methods = res["methods"]
    assert set(methods) == {"charm", "rm+", "merge", "ring", "ring-flash"}
    assert res["shim_max_diff"] < 1e-4
    for name, r in methods.items():
        for mode in ("fwd", "fwdbwd"):
            assert r[mode]["n"] == 2 and 0 < r[mode]["min"] <= r[mode]["median"]
            assert r[mode]["bound_ratio"] > 0
            assert r[mode]["cpu_s"] > 0  # every rank's process CPU time, summed
        # bf16 inputs: every method is as close to float64 attention as bf16 outputs allow.
        assert max(r["ref_err"].values()) < 0.1, (name, r["ref_err"])
    # The outside baseline agrees with ours (bf16 rounding of out and grads).
    agree = methods["ring-flash"]["agree"]
    assert max(agree.values()) < 0.05, agree
    ours, theirs = methods["charm"]["ref_err"], methods["ring-flash"]["ref_err"]
    for key in ("out", "dq", "dk", "dv"):
        assert ours[key] <= 2 * theirs[key] + 1e-3, (key, ours, theirs)
    # What the executor sent equals what the plan says it sends.
    for name in ("charm", "ring"):
        sent = methods[name]["fwdbwd"]["sent_bytes"]
        for p in ("fwd", "bwd"):
            b = methods[name]["bytes"][p]
            assert sum(sent[p].values()) == b["intra"] + b["cross"]
    assert 0 < res["ccr"]["fwd"] and 0 < res["pure_compute_s"]["fwdbwd"]
    assert methods["charm"]["fwdbwd"]["peak_buffer_bytes"]["bwd"] > 0
    # the machine it ran on, to set next to a profile's (the GPU only where torch sees one)
    here = host()
    assert [res["host"][k] for k in ("cpu", "cores", "isa")] == [
        here[k] for k in ("cpu", "cores", "isa")
    ]


def test_link_bytes_follow_the_cross_level_the_call_uses():
    # GQA: charm ships kv in both passes, so neither pass moves more across nodes than ring
    shape = AttnShape(1, 64, 8, 2, 16)
    layout = Layout(2, 2)
    charm = method_bytes("charm", layout, True, shape, "shared")
    ring = method_bytes("ring", layout, True, shape, "shared")
    for name in ("fwd", "bwd"):
        assert charm[name].max_cross_link <= ring[name].max_cross_link, name


def _small_run(tmp_path, *flags: str) -> dict:
    """The methods' results of one tiny loopback benchmark with the reference check."""
    out = tmp_path / "res.json"
    main(
        [
            "attention", "--launcher", "loopback", *flags,
            "--iters", "1", "--warmup", "0", "--reference", "--quiet", "--timeout", "50",
            "--json", str(out),
        ]
    )  # fmt: skip
    return json.loads(out.read_text())["methods"]


def test_attention_benchmark_runs_ring_contig(tmp_path):
    # ring-contig re-shards the zigzag inputs to contiguous ones and its results back: it agrees
    # with the zigzag ring, and it sends the same bytes as its plan.
    methods = _small_run(
        tmp_path,
        "--nodes", "1", "--ranks-per-node", "2", "--methods", "ring,ring-contig",
        "--seq-local", "32", "--heads", "2", "--head-dim", "16", "--batch", "1",
    )  # fmt: skip
    assert set(methods) == {"ring", "ring-contig"}
    contig = methods["ring-contig"]
    assert max(contig["ref_err"].values()) < 0.1, contig["ref_err"]
    assert max(contig["agree"].values()) < 0.05, contig["agree"]
    for p in ("fwd", "bwd"):
        b = contig["bytes"][p]
        assert sum(contig["fwdbwd"]["sent_bytes"][p].values()) == b["intra"] + b["cross"]


# the non-causal run: make test-heavy (about 10 s)
@pytest.mark.parametrize(
    "causal", ["--causal", pytest.param("--no-causal", marks=pytest.mark.heavy)]
)
def test_attention_benchmark_runs_ring_flash_llama3_and_tasp(tmp_path, causal):
    # ring-flash-attention's Llama 3 variant (varlen, on the shim's varlen functions, contiguous
    # shards) and TASP (s_local divisible by 2 * (3 - 1)) both match the float64 reference
    methods = _small_run(
        tmp_path,
        "--nodes", "1", "--ranks-per-node", "3", "--methods", "ring,ring-flash-llama3,tasp",
        "--seq-local", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
        "--batch", "1", causal,
    )  # fmt: skip
    assert set(methods) == {"ring", "ring-flash-llama3", "tasp"}
    for name in ("ring-flash-llama3", "tasp"):
        res = methods[name]
        assert max(res["ref_err"].values()) < 0.1, (name, res["ref_err"])
        assert max(res["agree"].values()) < 0.05, (name, res["agree"])


# the non-causal run: make test-heavy (about 10 s)
@pytest.mark.parametrize(
    "causal", ["--causal", pytest.param("--no-causal", marks=pytest.mark.heavy)]
)
def test_attention_benchmark_runs_usp(tmp_path, causal):
    # yunchang's USP (Ulysses in each node x zigzag ring across nodes) on the flash-attn shim,
    # on its own shard layout: within the bf16 reference tolerance, like ring
    methods = _small_run(
        tmp_path,
        "--nodes", "2", "--ranks-per-node", "2", "--methods", "ring,usp",
        "--seq-local", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
        "--batch", "1", "--dtype", "bf16", causal,
    )  # fmt: skip
    usp, ring = methods["usp"]["ref_err"], methods["ring"]["ref_err"]
    for name in ("out", "dq", "dk", "dv"):
        assert usp[name] < 4 * ring[name] + 1e-2, (name, usp, ring)


def test_usp_refuses_float32():
    from megatron_charm.bench.methods import USP, Inputs

    t = torch.zeros(1, 8, 4, 16)
    inp = Inputs(t, t, t, t, torch.arange(8))
    with pytest.raises(ValueError, match="float32"):
        USP("usp", inp, True, 0.25, topo=None, use_shim=True)


def test_numerics_method_entries_carry_plan_options():
    from megatron_charm.bench.numerics import method_options
    from megatron_charm.plan import PlanOptions

    assert method_options("ring") == PlanOptions(method="ring")
    got = method_options("charm:cross_return=fp32:window=1:combine_nodes=true")
    assert got == PlanOptions(cross_return="fp32", window=1, combine_nodes=True)
    with pytest.raises(ValueError, match="'speed=2' is not key=value with a PlanOptions field"):
        method_options("charm:speed=2")
    with pytest.raises(ValueError, match="unknown CP attention method 'chram'"):
        method_options("chram")


def test_kv_heads_of_zero_is_refused_not_taken_for_heads() -> None:
    import argparse

    from megatron_charm.bench.attention import add_arguments, config_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    with pytest.raises(ValueError, match="--kv-heads 0 must be >= 1"):
        config_from_args(ap.parse_args(["--heads", "4", "--kv-heads", "0"]))
    assert config_from_args(ap.parse_args(["--heads", "4"]))["kv_heads"] == 4
    assert config_from_args(ap.parse_args(["--heads", "4", "--kv-heads", "2"]))["kv_heads"] == 2
