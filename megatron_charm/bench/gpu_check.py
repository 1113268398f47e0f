"""The one-GPU check (``scripts/gpu_check.sh``), also runnable on CPU kernels (``--device cpu``).

Checks, each written to the JSON report as soon as it ends (a partial run still reports):

1. ``versions``: torch, CUDA, NCCL, flash-attn, Transformer Engine, megatron-core, and the
   flash-attn call form that the adapter selected from its signature.
2. ``kernel_matrix``: every available block kernel (no ``math``: it is the reference) over dtypes,
   heads/kv heads, head dims and block shapes on non-contiguous slices, forward and merged-lse
   backward against float64 (see :mod:`megatron_charm.bench.kernel_matrix`).
3. ``merge``: :func:`~megatron_charm.kernels.merge.merge_partial` against float64, and its
   bandwidth (recorded, not asserted).
4. ``speed`` (CUDA only): kernel and SDPA TFLOP/s per dtype and head dim (recorded).
5. ``cp1``: ``cp_attention`` on a one-rank group (NCCL on CUDA, gloo on CPU), every method,
   forward and backward, against SDPA.

Not implemented yet (the report says so): CP with several processes on one GPU, megatron-core
``GPTModel`` on CUDA, and the ``CUDA_DEVICE_MAX_CONNECTIONS`` overlap measurement.

Exit status: 0 when every check passed, 1 on any failure, 2 when ``--device cuda`` has no CUDA.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

from megatron_charm.bench.kernel_matrix import DTYPES, MatrixConfig, run_matrix

Tensor = torch.Tensor
CHECKS = ("versions", "kernel_matrix", "merge", "speed", "cp1")
NOT_IMPLEMENTED = {
    "cp_multiprocess": "CP with 4 processes on one GPU (NCCL and staged gloo): not implemented",
    "megatron_core_cuda": "GPTModel + CharmDotProductAttention and 20 train iterations: not "
    "implemented",
    "max_connections": "overlap with CUDA_DEVICE_MAX_CONNECTIONS=1 vs 8: not implemented",
}


class Report:
    """The JSON report, rewritten after every check."""

    def __init__(self, path: str | None, device: torch.device) -> None:
        self.path = Path(path) if path else None
        self.data: dict = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "checks": {},
            "not_implemented": NOT_IMPLEMENTED,
            "failures": [],
        }

    def record(self, name: str, result, failures: list[str]) -> None:
        self.data["checks"][name] = result
        self.data["failures"].extend(f"{name}: {f}" for f in failures)
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


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
        iface, why = load_flash_attn()
        info["flash_attn_adapter"] = iface.describe() if iface is not None else why
    return info


def _kernels(device: torch.device):
    from megatron_charm.kernels import available_kernels, select_kernel

    names = [n for n in available_kernels(device) if n != "math"]
    # flash_attn takes only half precision; select_kernel checks the (device, dtype) pair per cell
    return [select_kernel(device, torch.bfloat16 if n == "flash_attn" else torch.float32, n)
            for n in names]  # fmt: skip


def kernel_matrix(device: torch.device, cfg: MatrixConfig, report: Report) -> tuple[dict, list]:
    kernels = _kernels(device)
    partial: dict = {"config": vars(cfg) | {"heads": [list(h) for h in cfg.heads]}}

    def save(rows: list) -> None:
        report.data["checks"]["kernel_matrix"] = partial | {"rows": rows}
        report.save()

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
    t = _timed(lambda: merge_partial(acc_o, acc_l, o_b, l_b), device)
    nbytes = 3 * o_a.numel() * 4 + 3 * l_a.numel() * 4
    res = {
        "max_err": err,
        "lse_err": lse_err,
        "ms": round(t, 4),
        "GB_s": round(nbytes / t / 1e6, 1),
    }
    bad = [f"merge error {err:.2e} / lse {lse_err:.2e} > 1e-5"] if max(err, lse_err) > 1e-5 else []
    return res, bad


def _timed(fn, device: torch.device, iters: int = 10) -> float:
    """Median milliseconds of ``fn()``."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _speed_cell(kern, q: Tensor, k: Tensor, v: Tensor, do: Tensor, device) -> dict:
    s, b, h, d = q.shape
    scale = d**-0.5
    flops = 4 * s * s * b * h * d * 0.5  # causal
    fwd = _timed(lambda: kern.forward(q, k, v, True, scale), device)
    o, lse = kern.forward(q, k, v, True, scale)
    bwd = _timed(lambda: kern.backward(do, q, k, v, o, lse, True, scale), device)
    return {
        "fwd_tflops": round(flops / fwd / 1e9, 1),
        "bwd_tflops": round(2.5 * flops / bwd / 1e9, 1),
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
    return {"shape_sbhd_causal": [seq, b, h], "rows": rows}, []


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


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(x) for x in p.split("/")) for p in text.split(","))  # type: ignore[misc]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--json", dest="json_out", default=None, help="report path (rewritten per check)"
    )
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"subset of {','.join(CHECKS)}")
    ap.add_argument("--seq", type=int, default=None, help="block size (default 1024 CUDA, 64 CPU)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--heads", default="16/16,16/4,16/1", help="query/kv head pairs")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--blocks", default=",".join(MatrixConfig.blocks))
    args = ap.parse_args(argv)
    unknown = set(args.checks.split(",")) - set(CHECKS)
    if unknown:
        ap.error(f"--checks: unknown {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.stderr.write(
            f"gpu_check: CUDA is not available (torch {torch.__version__}, cuda build "
            f"{torch.version.cuda}); run on a GPU machine, or pass --device cpu to check the CPU "
            "kernels.\n"
        )
        return 2
    if device.type == "cuda":
        from megatron_charm.device import set_cuda_device_from_env

        device = torch.device("cuda", set_cuda_device_from_env())
    seq = args.seq or (1024 if device.type == "cuda" else 64)
    cfg = MatrixConfig(
        seq=seq,
        batch=args.batch,
        dtypes=tuple(args.dtypes.split(",")),
        heads=_pairs(args.heads),
        head_dims=tuple(int(x) for x in args.head_dims.split(",")),
        blocks=tuple(args.blocks.split(",")),
    )
    report = Report(args.json_out, device)
    report.save()
    selected = args.checks.split(",")
    t_all = time.time()
    for name in CHECKS:
        if name not in selected or (name == "speed" and device.type != "cuda"):
            continue
        t0 = time.time()
        try:
            if name == "versions":
                result, bad = versions(device), []
            elif name == "kernel_matrix":
                result, bad = kernel_matrix(device, cfg, report)
            elif name == "merge":
                result, bad = merge_check(device, 4 * seq)
            elif name == "speed":
                result, bad = speed(device, 8 * seq)
            else:
                result, bad = cp1(device, seq)
        except Exception as exc:  # noqa: BLE001 - report the crash, go on with the next check
            result, bad = {"error": f"{type(exc).__name__}: {exc}"}, [f"crashed: {exc}"]
        if isinstance(result, dict):
            result["seconds"] = round(time.time() - t0, 1)
        report.record(name, result, bad)
        status = "ok" if not bad else f"FAILED ({len(bad)})"
        print(
            f"gpu_check {name}: {status} in {time.time() - t0:.1f} s", file=sys.stderr, flush=True
        )
    report.data["seconds"] = round(time.time() - t_all, 1)
    report.save()
    for f in report.data["failures"]:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if report.data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
