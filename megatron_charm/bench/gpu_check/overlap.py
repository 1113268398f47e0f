"""``overlap``: one CP = 4 step's time breakdown, and on CUDA the step with 1 and 8 hardware queues.

Four spawned processes run ``cp_attention`` (charm, causal, 2 nodes x 2) forward and backward a
few times; the last step is traced (``trace=`` of ``cp_attention``), and the trace is split into
compute (``Compute`` and ``Merge`` instructions) and communication (``Exchange`` and ``Wait``),
per pass, on the slowest rank. On CUDA the trace holds host enqueue times, not device times, so
the breakdown shows where the host spends the step; the synchronised step time is measured with
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (what Megatron-LM requires with CP before Blackwell: one hardware
queue for every stream) and ``=8``, set for the child processes before they create their CUDA
contexts. A step that overlaps communication with compute under 8 queues and loses it under 1 is
slower with 1. Recorded, not asserted. On CPU only the breakdown runs.
"""

from __future__ import annotations

import time

import torch

from megatron_charm.bench.gpu_check.cp4 import DTYPES, nccl_env
from megatron_charm.bench.gpu_check.procs import RanksFailed, init_group, run_ranks
from megatron_charm.device import set_cuda_device

WORLD = 4
STEPS = 5
COMPUTE = ("Compute", "Merge")
COMM = ("Exchange", "Wait")


def breakdown(events: list[tuple[str, str, float, float]]) -> dict:
    """Seconds of compute, communication and the whole pass from a trace's events (pure)."""
    if not events:
        return {"compute_s": 0.0, "comm_s": 0.0, "span_s": 0.0}
    compute = sum(e - s for kind, _, s, e in events if kind in COMPUTE)
    comm = sum(e - s for kind, _, s, e in events if kind in COMM)
    span = max(e for *_, e in events) - min(s for _, _, s, _ in events)
    return {"compute_s": compute, "comm_s": comm, "span_s": span}


def overlap_worker(global_rank: int, world: int, port: int, cfg: dict) -> dict:
    """One rank: warm-up, timed steps, and the trace of the last step."""
    import torch.distributed as dist

    import megatron_charm as mc
    from megatron_charm.bench.gpu_check import staged

    device = torch.device(cfg["device"])
    on_cuda = device.type == "cuda"
    if on_cuda:
        set_cuda_device(0)
        device = torch.device("cuda", 0)
    transport = cfg["transport"]
    init_group(global_rank, world, port, "nccl" if transport == "nccl" else "gloo", 120)
    if transport == "gloo-staged":
        staged.install()
    try:
        topo = mc.CPTopology.build(None, ranks_per_node=2)
        if transport == "gloo-staged":
            staged.allow_device(topo)
        b, s, h, h_kv, d = cfg["shape"]
        dtype = DTYPES[cfg["dtype"]]
        g = torch.Generator().manual_seed(5 + global_rank)
        q, do = (torch.randn(b, s, h, d, generator=g).to(device, dtype) for _ in range(2))
        k, v = (torch.randn(b, s, h_kv, d, generator=g).to(device, dtype) for _ in range(2))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        times, trace = [], []
        for step in range(2 + STEPS):
            trace = []
            dist.barrier()
            if on_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = mc.cp_attention(q, k, v, topo, method="charm", causal=True, trace=trace)
            out.backward(do)
            if on_cuda:
                torch.cuda.synchronize()
            if step >= 2:
                times.append(time.perf_counter() - t0)
        passes = {("backward" if t.backward else "forward"): breakdown(t.events) for t in trace}
        return {"step_s": sorted(times)[len(times) // 2], "passes": passes}
    finally:
        staged.uninstall()
        dist.destroy_process_group()


def _slowest(per_rank: list[dict]) -> dict:
    """The step time and per-pass breakdown of the slowest rank, in milliseconds."""
    worst = max(per_rank, key=lambda r: r["step_s"])
    return {
        "step_ms": round(worst["step_s"] * 1e3, 3),
        "passes": {p: {k.replace("_s", "_ms"): round(x * 1e3, 3) for k, x in v.items()}
                   for p, v in worst["passes"].items()},
    }  # fmt: skip


def _run(cfg: dict, env: dict[str, str], plant: str | None) -> dict:
    """The first transport that runs (NCCL, then staged gloo on CUDA; gloo on CPU)."""
    tried = {}
    for transport in cfg["transports"]:
        try:
            per_rank = run_ranks(
                overlap_worker, WORLD, cfg | {"transport": transport}, timeout_s=90,
                env=env, plant=plant, per_rank_env=nccl_env if transport == "nccl" else None,
            )  # fmt: skip
        except RanksFailed as exc:
            tried[transport] = str(exc).splitlines()[0][:300]
            continue
        return {"transport": transport, "not_run": tried} | _slowest(per_rank)
    return {"transport": None, "not_run": tried}


def overlap(
    device: torch.device, s_local: int, plant: str | None, save_partial, try_nccl: bool = True
):
    """Breakdown on every device; the connections comparison on CUDA (NCCL when ``try_nccl``,
    else, or when NCCL does not run, staged gloo). Never fails on timings; fails only when no
    transport could run the step."""
    on_cuda = device.type == "cuda"
    shape = [1, 4 * s_local, 16, 4, 128] if on_cuda else [1, s_local, 4, 2, 16]
    cfg = {
        "device": device.type, "dtype": "bf16" if on_cuda else "fp32", "shape": shape,
        "transports": ((["nccl"] if try_nccl else []) + ["gloo-staged"]) if on_cuda else ["gloo"],
    }  # fmt: skip
    result: dict = {"shape_b_slocal_h_hkv_d": shape, "method": "charm", "split": "2x2",
                    "causal": True, "host_times": on_cuda}  # fmt: skip
    bad = []
    if not on_cuda:
        result["breakdown"] = _run(cfg, {}, plant)
        result["max_connections"] = "skipped: CUDA_DEVICE_MAX_CONNECTIONS is a CUDA setting"
        if result["breakdown"]["transport"] is None:
            bad.append(f"no transport ran the step: {result['breakdown']['not_run']}")
        return result, bad
    result["max_connections"] = {}
    for n in (1, 8):
        run = _run(cfg, {"CUDA_DEVICE_MAX_CONNECTIONS": str(n)}, plant)
        result["max_connections"][str(n)] = run
        if run["transport"] is None:
            bad.append(f"CUDA_DEVICE_MAX_CONNECTIONS={n}: no transport ran the step")
        save_partial(result)
    runs = result["max_connections"]
    if all(runs[n].get("step_ms") for n in ("1", "8")):
        result["slowdown_1_vs_8"] = round(runs["1"]["step_ms"] / runs["8"]["step_ms"], 3)
    return result, bad
