"""The single-process checks of the one-GPU check: versions, kernel matrix, merge, speed, cp1."""

from __future__ import annotations

import importlib.metadata
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.nn.functional as F  # noqa: N812

from megatron_charm.bench.kernel_matrix import DTYPES, MatrixConfig, run_matrix
from megatron_charm.bench.kernel_shapes import device_ms
from megatron_charm.sim.compute import BWD_FLOPS_RATIO
from megatron_charm.sim.profile import block_flops_full

Tensor = torch.Tensor


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(device: torch.device) -> dict:
    from megatron_charm.kernels.flash_attn_kernel import load_flash_attn

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "flash_attn": _version("flash-attn"),
        "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
        "megatron_core": _version("megatron-core"),
    }
    if device.type == "cuda":
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        from megatron_charm.nodes import cuda_device_pci, format_pci, sysfs_numa_node

        pci = cuda_device_pci(device.index or 0)  # what node_split="numa" reads
        info["gpu_pci"], info["gpu_numa_node"] = format_pci(pci), sysfs_numa_node(pci)
        iface, why = load_flash_attn()
        info["flash_attn_adapter"] = iface.describe() if iface is not None else why
    return info


def _kernels(device: torch.device):
    from megatron_charm.kernels import available_kernels, select_kernel

    names = [n for n in available_kernels(device) if n != "math"]
    # flash_attn takes only half precision; select_kernel checks the (device, dtype) pair per cell
    return [select_kernel(device, torch.bfloat16 if n == "flash_attn" else torch.float32, n)
            for n in names]  # fmt: skip


def kernel_matrix(
    device: torch.device, cfg: MatrixConfig, save_partial: Callable[[dict], None]
) -> tuple[dict, list]:
    kernels = _kernels(device)
    partial: dict = {"config": vars(cfg) | {"heads": [list(h) for h in cfg.heads]}}

    def save(rows: list) -> None:
        save_partial(partial | {"rows": rows})

    rows = []
    for kern in kernels:
        dts = [d for d in cfg.dtypes if kern.name != "flash_attn" or d != "fp32"]
        sub = MatrixConfig(**(vars(cfg) | {"dtypes": tuple(dts)}))
        rows += run_matrix([kern], sub, device, lambda r, done=list(rows): save(done + r))
    bad = [
        f"{r['kernel']} {r['dtype']} heads={r['heads']} d={r['head_dim']} {r['block']}: "
        f"{r['failed']}"
        for r in rows
        if not r["ok"]
    ]
    return partial | {"rows": rows, "cells": len(rows), "failed_cells": len(bad)}, bad


def merge_check(device: torch.device, seq: int) -> tuple[dict, list]:
    from megatron_charm.kernels.merge import merge_partial

    g = torch.Generator().manual_seed(1)
    s, b, h, d = seq, 2, 16, 128
    o_a, o_b = (torch.randn(s, b, h, d, generator=g).to(device) for _ in range(2))
    l_a, l_b = (torch.randn(s, b, h, generator=g).to(device) * 4 for _ in range(2))
    w = torch.sigmoid(l_b.double() - l_a.double()).unsqueeze(-1)
    ref = (1 - w) * o_a.double() + w * o_b.double()
    acc_o, acc_l = o_a.clone(), l_a.clone()
    merge_partial(acc_o, acc_l, o_b, l_b)
    err = (acc_o.double() - ref).abs().max().item()
    lse_err = (acc_l.double() - torch.logaddexp(l_a.double(), l_b.double())).abs().max().item()
    t = device_ms(lambda: merge_partial(acc_o, acc_l, o_b, l_b), device)
    nbytes = 3 * o_a.numel() * 4 + 3 * l_a.numel() * 4
    res = {
        "max_err": err,
        "lse_err": lse_err,
        "ms": round(t, 4),
        "GB_s": round(nbytes / t / 1e6, 1),
    }
    bad = [f"merge error {err:.2e} / lse {lse_err:.2e} > 1e-5"] if max(err, lse_err) > 1e-5 else []
    return res, bad


def _speed_cell(kern, q: Tensor, k: Tensor, v: Tensor, do: Tensor, device) -> dict:
    s, b, h, d = q.shape
    scale = d**-0.5
    flops = block_flops_full(b, h, d, s) * 0.5  # causal: half the block
    fwd = device_ms(lambda: kern.forward(q, k, v, True, scale), device)
    o, lse = kern.forward(q, k, v, True, scale)
    bwd = device_ms(lambda: kern.backward(do, q, k, v, o, lse, True, scale), device)
    return {
        "fwd_tflops": round(flops / fwd / 1e9, 1),
        "bwd_tflops": round(BWD_FLOPS_RATIO * flops / bwd / 1e9, 1),
    }


def speed(device: torch.device, seq: int) -> tuple[dict, list]:
    rows = {}
    b, h = 2, 16
    for kern in _kernels(device):
        for dt in ("bf16", "fp16", "fp32"):
            if kern.name == "flash_attn" and dt == "fp32":
                continue
            for d in (64, 128):
                q, k, v, do = (
                    torch.randn(seq, b, h, d, device=device, dtype=DTYPES[dt]) for _ in range(4)
                )
                rows[f"{kern.name} {dt} d={d}"] = _speed_cell(kern, q, k, v, do, device)
    # full blocks over the shapes a CP step runs (Table 5's heads among them): the fixed cost
    # and rate the simulator's compute model needs (megatron_charm.bench.kernel_shapes)
    from megatron_charm.bench.kernel_shapes import GPU_CHECK_GRID, sweep

    shapes = {
        kern.name: list(sweep(kern, device, *GPU_CHECK_GRID, iters=10, max_tokens=65536))
        for kern in _kernels(device)
    }
    return {"shape_sbhd_causal": [seq, b, h], "rows": rows, "block_shapes": shapes}, []


def cp1(device: torch.device, seq: int) -> tuple[dict, list]:
    import torch.distributed as dist

    import megatron_charm as mc
    from megatron_charm.plan import METHODS

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    bad, rows = [], {}
    try:
        topo = mc.CPTopology.build(None)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        b, h, h_kv, d = 2, 16, 4, 64
        g = torch.Generator().manual_seed(2)
        q, do = (torch.randn(b, seq, h, d, generator=g).to(device, dtype) for _ in range(2))
        k, v = (torch.randn(b, seq, h_kv, d, generator=g).to(device, dtype) for _ in range(2))
        rq, rk, rv = (t.double().requires_grad_() for t in (q, k, v))
        ro = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (rq, rk, rv)), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
        ro.backward(do.double())
        tol = 5e-2 if dtype != torch.float32 else 1e-4
        for method in METHODS:
            lq, lk, lv = (t.clone().requires_grad_() for t in (q, k, v))
            out = mc.cp_attention(lq, lk, lv, topo, method=method, causal=True)
            out.backward(do)
            err = max(
                (a.double() - r).abs().max().item()
                for a, r in zip((out, lq.grad, lk.grad, lv.grad), (ro, rq.grad, rk.grad, rv.grad),
                                strict=True)
            )  # fmt: skip
            rows[method] = {"max_err_vs_fp64_sdpa": err, "tol": tol}
            if not err <= tol:
                bad.append(f"cp_attention {method}: {err:.2e} > {tol:.0e}")
    finally:
        dist.destroy_process_group()
    return {"shape_bshd": [b, seq, h, h_kv, d], "rows": rows}, bad
