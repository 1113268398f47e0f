"""One rank of ``megatron-charm-bench attention``: checks, timings, traces; rank 0 writes JSON.

Launched by :mod:`megatron_charm.bench.attention` (testbed or loopback) or by torchrun/srun
(``--launcher env``). Reads its settings from a JSON file; ``RANK``/``WORLD_SIZE``/``MASTER_*``
come from the launcher.

Timing rules: every timed call starts after a barrier; a call's time is the slowest rank's; the
methods are interleaved inside each iteration, so load changes on a shared machine hit all of
them alike. "Compute" of our methods is the time in ``Compute``/``Reduce`` instructions (kernels
and merges, from the executor trace); of ring-flash-attention the time in its flash-attn calls
(kernels only; its merges count as not computing).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_charm import env
from megatron_charm.bench.methods import (
    OURS,
    Inputs,
    barrier,
    doc_mask,
    make_contender,
    plan_options,
)
from megatron_charm.constants import DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    from megatron_charm.comm.topology import CPTopology

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


#: Outside implementations that run on the flash-attn shim on CPU (checked before timing).
SHIMMED = ("ring-flash", "ring-flash-llama3", "usp")


def make_inputs(cfg: dict, cp_rank: int, cp_size: int, device: torch.device) -> Inputs:
    """This rank's zigzag share of a seeded global problem (identical on every rank)."""
    from megatron_charm.plan import zigzag_positions

    b, s, h, h_kv, d = (
        cfg["batch"],
        cfg["seq_local"],
        cfg["heads"],
        cfg["kv_heads"],
        cfg["head_dim"],
    )
    seq = s * cp_size
    idx = torch.tensor(zigzag_positions(cp_rank, cp_size, seq))
    gen = torch.Generator().manual_seed(cfg["seed"])
    dtype = DTYPES[cfg["dtype"]]
    # Generate only this rank's rows, but from the same global stream on every rank.
    full = [torch.randn(b, seq, hh, d, generator=gen) for hh in (h, h_kv, h_kv, h)]
    q, k, v, dout = (t[:, idx].to(device=device, dtype=dtype).contiguous() for t in full)
    return Inputs(q, k, v, dout, idx)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _reference_errors(cfg, inp: Inputs, results: dict, causal, scale, cp_size) -> dict:
    """Max |diff| of every method's out, dq, dk, dv from float64 attention over the whole
    sequence (inputs rounded to the benchmark dtype first). Small sizes only."""
    from megatron_charm.kernels.backends import _KERNELS

    dtype = DTYPES[cfg["dtype"]]
    seq = cfg["seq_local"] * cp_size
    gen = torch.Generator().manual_seed(cfg["seed"])
    b, h, h_kv, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    full = [torch.randn(b, seq, hh, d, generator=gen) for hh in (h, h_kv, h_kv, h)]
    q, k, v, dout = (t.to(dtype).double().transpose(0, 1) for t in full)  # [s, b, h, d]
    math = _KERNELS["math"]
    out, lse = math.forward(q, k, v, causal, scale)
    grads = math.backward(dout, q, k, v, out, lse, causal, scale)
    refs = [t.transpose(0, 1)[:, inp.idx] for t in (out, *grads)]
    return {
        name: {
            key: _max_diff(got.cpu(), want)
            for key, got, want in zip(("out", "dq", "dk", "dv"), res, refs, strict=True)
        }
        for name, res in results.items()
    }


def _gather(obj) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _saved_bytes(fn, inputs: list[torch.Tensor]) -> tuple[int, int]:
    """Bytes autograd keeps between forward and backward for ``fn()``: all, and beyond the
    caller's input tensors (unique storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    own = {t.untyped_storage().data_ptr() for t in inputs}
    total = sum(seen.values())
    return total, total - sum(n for p, n in seen.items() if p in own)


def _timed(contender, backward: bool, device: torch.device) -> dict:
    from megatron_charm.bench import flash_shim

    ours = contender.name in OURS
    traces: list = []
    if ours:
        contender.trace = traces
    k0 = list(flash_shim.KERNEL_SECONDS)
    barrier(device)
    c0 = time.process_time()
    t0 = time.perf_counter()
    if backward:
        contender.forward_backward()
    else:
        contender.forward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rec = {"wall": wall, "cpu": time.process_time() - c0}
    if ours:
        contender.trace = None
        rec["compute"] = sum(
            e - s for tr in traces for kind, _, s, e in tr.events if kind in ("Compute", "Merge")
        )
        rec["peak"] = {
            ("bwd" if tr.backward else "fwd"): tr.stats.peak_buffer_bytes for tr in traces
        }
        rec["sent"] = {
            ("bwd" if tr.backward else "fwd"): dict(tr.stats.bytes_sent) for tr in traces
        }
        rec["events"] = [
            (("bwd" if tr.backward else "fwd"), kind, ch, s - t0, e - t0)
            for tr in traces
            for kind, ch, s, e in tr.events
        ]
    elif contender.name in SHIMMED and device.type == "cpu":
        rec["compute"] = sum(flash_shim.KERNEL_SECONDS) - sum(k0)
    return rec


def start_rank(cfg: dict) -> tuple[torch.device, CPTopology]:
    """Threads, device (``cfg["device"]``: cpu with gloo, cuda with NCCL on ``LOCAL_RANK``'s
    GPU), the default process group (``cfg["timeout_s"]``) and the job's CP topology."""
    from megatron_charm import CPTopology

    torch.set_num_threads(cfg.get("threads", 1))
    device = torch.device(cfg.get("device", "cpu"))
    if device.type == "cuda":
        from megatron_charm.device import set_cuda_device_from_env

        set_cuda_device_from_env()
        device = torch.device("cuda", torch.cuda.current_device())
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=cfg.get("timeout_s", DEFAULT_TIMEOUT_S))
        dist.init_process_group(backend, timeout=timeout)
    # The bench worker is an entry point: the loopback launcher and the testbed give each rank
    # its node identity in MEGATRON_CHARM_NODE_ID, read here and passed down as data.
    topo = CPTopology.build(None, ranks_per_node=cfg.get("ranks_per_node"), node_id=env.node_id())
    return device, topo


def run(cfg: dict) -> dict | None:
    """Benchmark on this rank; returns the result dict on rank 0, ``None`` elsewhere."""
    from megatron_charm.bench.sequential import NULL_KERNEL, run_sequential_ring

    device, topo = start_rank(cfg)
    cp_rank, cp_size = topo.cp_rank, topo.cp_size
    causal, d = cfg["causal"], cfg["head_dim"]
    scale = d**-0.5
    inp = make_inputs(cfg, cp_rank, cp_size, device)

    shim_err = None
    if any(m in SHIMMED for m in cfg["methods"]) and device.type == "cpu":
        from megatron_charm.bench.flash_shim import check_shim

        shim_err = check_shim()  # before anything is timed; raises if wrong
    mask = doc_mask(cfg, cfg["seq_local"] * cp_size)
    opts = {"kernel": cfg.get("kernel"), "options": plan_options(cfg), "mask": mask}
    contenders = [make_contender(m, inp, causal, scale, topo, opts) for m in cfg["methods"]]

    # Agreement: every method's out and grads against the first of ours (or the first method).
    ref_name = next((m for m in cfg["methods"] if m in OURS), cfg["methods"][0])
    results = {c.name: c.comparable(c.forward_backward()) for c in contenders}
    ref = results[ref_name]
    agree = {
        name: {
            k: _max_diff(a, b) for k, a, b in zip(("out", "dq", "dk", "dv"), res, ref, strict=True)
        }
        for name, res in results.items()
    }
    if cfg.get("reference"):
        ref_err = _reference_errors(cfg, inp, results, causal, scale, cp_size)
    else:
        ref_err = None
    del results, ref
    saved = {}
    for c in contenders:
        tensors = [c.q, c.k, c.v]
        saved[c.name] = _saved_bytes(c._call, tensors)

    # Warm-up, then interleaved timed iterations.
    for _ in range(cfg["warmup"]):
        for c in contenders:
            c.forward_backward()
    recs: dict[str, dict[str, list]] = {c.name: {"fwd": [], "fwdbwd": []} for c in contenders}
    for _ in range(cfg["iters"]):
        for c in contenders:
            recs[c.name]["fwd"].append(_timed(c, False, device))
        for c in contenders:
            recs[c.name]["fwdbwd"].append(_timed(c, True, device))

    # Sequential ring: CCR and pure compute time.
    q_s, k_s, v_s, do_s = (t.transpose(0, 1).contiguous() for t in (inp.q, inp.k, inp.v, inp.dout))
    seq_runs = []
    for i in range(cfg["warmup"] + cfg["iters"]):
        barrier(device)
        f, b = run_sequential_ring(topo, q_s, k_s, v_s, do_s, causal, scale, cfg.get("kernel"))
        if i >= cfg["warmup"]:
            seq_runs.append([f.compute, f.comm, b.compute, b.comm])
    # Communication alone: the same sequential ring with a kernel that computes nothing.
    for i in range(len(seq_runs)):
        barrier(device)
        f, b = run_sequential_ring(topo, q_s, k_s, v_s, do_s, causal, scale, NULL_KERNEL)
        seq_runs[i] += [f.comm, b.comm]

    mine = {
        "cp_rank": cp_rank,
        "node": topo.layout.node(cp_rank),
        "recs": recs,
        "seq": seq_runs,
        "agree": agree,
        "ref_err": ref_err,
        "saved": saved,
    }
    everyone = _gather(mine)
    dist.barrier()
    layout = topo.layout
    dist.destroy_process_group()
    if cp_rank != 0:
        return None
    return {
        "layout": [layout.num_nodes, layout.ranks_per_node],
        "backend": topo.backend,
        "device": str(device),
        "shim_max_diff": shim_err,
        "ranks": everyone,
    }


def main(config_path: str) -> None:
    with open(config_path) as f:
        cfg = json.load(f)
    res = run(cfg)
    if res is not None:
        with open(cfg["raw_out"], "w") as f:
            json.dump(res, f)
    sys.stdout.flush()
