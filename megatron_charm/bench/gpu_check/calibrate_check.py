"""``calibrate``: ``megatron-charm-sim calibrate``'s measurements on this device, fitted and used.

Two spawned processes share device 0 as a CP group of 2 nodes x 1 rank and run the calibrate
worker (:mod:`megatron_charm.sim.calibrate_worker`): block kernels over block sizes, merges,
P2P latency and bandwidth over message sizes, and kernels timed while a transfer runs. On CUDA
the transfers go through NCCL (``NCCL_HOSTID`` per process, sockets only: several processes on one
GPU; best effort, like ``cp4``'s ``nccl``), on CPU through gloo. The samples are fitted into a
profile (:func:`megatron_charm.sim.profile.fit_profile`), which must:

* be a valid profile: finite, positive kernel rates, merge and link bandwidths, and slowdowns
  >= 1 (the profile's own validation, which refuses anything else with a ``ValueError``);
* on CUDA, reach at least ``MIN_CUDA_TFLOPS`` in the forward block kernel (an H100-class GPU runs
  the bf16 flash kernel at over 100; below the floor the timing or the kernel choice is wrong);
* fit its own samples within ``MAX_FIT_ERROR`` (the largest relative residual of every fit);
* on CUDA, carry the host's enqueue cost per pass, exchange, kernel call and merge, read from the
  attention's own trace (Note [Enqueue ahead] in :mod:`megatron_charm.sim.engine`), each above
  0 and below ``MAX_ENQUEUE_S`` (an operation whose enqueue takes longer waits for the device:
  something in the pass synchronizes);
* load back from its JSON and drive the simulator's ``auto`` choice for this 2 x 1 group.

Any miss fails the check. The numbers are on one GPU with socket transport: they check the
measuring and fitting path, not a cluster's links.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

import torch

from megatron_charm.bench.gpu_check.cp4 import nccl_env
from megatron_charm.bench.gpu_check.procs import RanksFailed, init_group, run_ranks

WORLD = 2
MIN_CUDA_TFLOPS = 5.0
MAX_FIT_ERROR = 1.0
MAX_ENQUEUE_S = 5e-3


def calibrate_worker(global_rank: int, world: int, port: int, cfg: dict) -> dict | None:
    import torch.distributed as dist

    from megatron_charm.sim.calibrate_worker import run

    backend = "nccl" if cfg["device"] == "cuda" else "gloo"
    init_group(global_rank, world, port, backend, cfg["timeout_s"])
    try:
        return run(cfg)
    finally:
        dist.destroy_process_group()


def _problems(profile) -> list[str]:
    """What a valid profile can still get wrong: fits that miss their own samples. The
    machine's speed moving during the run (``drift``, Note [A calibration's drift]) is no fit:
    the report shows it, and it fails nothing."""
    return [
        f"fit of {k} misses its samples by {v:.0%} (> {MAX_FIT_ERROR:.0%})"
        for k, v in profile.fit_error.items()
        if k != "drift" and not v <= MAX_FIT_ERROR
    ]


def _enqueue_problems(enqueue, result: dict) -> list[str]:
    """A CUDA profile's enqueue costs, recorded in ``result``; each must be in (0, max)."""
    costs = dataclasses.asdict(enqueue)
    result["enqueue_us"] = {k: round(v * 1e6, 1) for k, v in costs.items()}
    return [
        f"enqueue of one {k} took {v * 1e6:.1f} us (expected above 0 and below "
        f"{MAX_ENQUEUE_S * 1e6:.0f} us)"
        for k, v in costs.items()
        if not 0 < v < MAX_ENQUEUE_S
    ]


def _host_problems(rec: dict, on_cuda: bool) -> list[str]:
    """The host record ``calibrate`` stores in a profile (``provenance.host``) must name the GPU
    on CUDA: ``auto`` compares it with the GPU a rank runs on."""
    if on_cuda and not (isinstance(rec.get("gpu"), str) and rec["gpu"]):
        return [f"the host record names no GPU ({rec}): profiles would not say which GPU"]
    return []


def calibrate_check(device: torch.device, plant: str | None) -> tuple[dict, list[str]]:
    """Measure, fit, check and use a profile; returns the result and the failures."""
    from megatron_charm.auto import choose_method
    from megatron_charm.bench.provenance import host
    from megatron_charm.plan import Layout
    from megatron_charm.plan.payloads import AttnShape
    from megatron_charm.sim import profile as profiles
    from megatron_charm.sim.calibrate import describe

    on_cuda = device.type == "cuda"
    cfg = {
        "device": device.type, "dtype": "bf16" if on_cuda else "fp32", "kernel": None,
        "batch": 1, "heads": 8, "kernel_heads": [1], "head_dim": 128 if on_cuda else 32,
        "tokens": [512, 1024, 2048, 4096] if on_cuda else [32, 64, 128],
        "sizes": [1 << 12, 1 << 16, 1 << 20, 1 << 22] if on_cuda else [1 << 10, 1 << 14, 1 << 16],
        "reps": 5 if on_cuda else 3, "threads": 1, "nodes": 2, "ranks_per_node": 1,
        "timeout_s": 120,
    }  # fmt: skip
    result: dict = {"config": cfg}
    start = time.time()
    try:
        per_rank = run_ranks(
            calibrate_worker, WORLD, cfg, timeout_s=240, plant=plant,
            per_rank_env=nccl_env if on_cuda else None,
        )  # fmt: skip
    except RanksFailed as exc:
        why = str(exc).splitlines()[0][:500]
        result.update(ran=False, why=why)
        # several processes on one GPU need NCCL over sockets, which may be refused here
        return result, ([] if on_cuda else [f"did not run: {why}"])
    raw = per_rank[0]
    raw["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result.update(ran=True, seconds=round(time.time() - start, 1))
    try:
        # the fabric is assumed, not measured (calibrate's default)
        profile = profiles.fit_profile(raw)
    except ValueError as err:  # a rate that is not positive and finite, a slowdown below 1
        return result, [f"the samples do not fit a profile: {err}"]
    result["profile"] = describe(profile)
    bad = _problems(profile)
    tflops = profile.compute["fwd_flops_per_s"] / 1e12
    result["forward_tflops"] = round(tflops, 3)
    if on_cuda and not tflops >= MIN_CUDA_TFLOPS:
        bad.append(f"forward block kernel at {tflops:.3g} TFLOP/s (< {MIN_CUDA_TFLOPS})")
    if on_cuda:
        bad += _enqueue_problems(profile.compute_model().enqueue_cost(), result)
    result["host"] = host()
    bad += _host_problems(result["host"], on_cuda)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        profile.save(path)
        loaded = profiles.load_profile(path)
        with open(path) as f:
            result["profile_keys"] = sorted(json.load(f))
    shape = AttnShape(1, 1024, 8, 8, cfg["head_dim"], 2 if on_cuda else 4)
    choice = choose_method(loaded, Layout(2, 1), shape, True)
    result["auto_picks"] = choice.method
    return result, bad
