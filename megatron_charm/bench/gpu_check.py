"""One-GPU check: block kernels against torch SDPA, merge bandwidth, ``cp_attention`` at CP = 1.

``scripts/gpu_check.sh`` runs this (``python -m megatron_charm.bench.gpu_check``); it needs CUDA
and exits with status 2 at once when there is none. Sized for well under 5 minutes on one H200.

1. Parity: every available block backend (``torch``: PyTorch's CUDA flash op; ``flash_attn`` if
   installed) forward and backward against float64 attention and against
   ``torch.nn.functional.scaled_dot_product_attention`` (bf16), causal and not.
2. Speed: forward and backward of each backend and of SDPA, CUDA-event timed, in TFLOP/s.
3. Merge: :func:`megatron_charm.kernels.merge.merge_partial` bandwidth in GB/s.
4. ``cp_attention`` on a one-rank NCCL group, every method, forward + backward, against SDPA, with
   ``torch.cuda.max_memory_allocated``.

Exit status 1 if a parity check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F  # noqa: N812

Tensor = torch.Tensor
FAILURES: list[str] = []


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.stderr.write(
            "gpu_check: CUDA is not available (torch "
            f"{torch.__version__}, cuda build {torch.version.cuda}); this check needs one GPU. "
            "Install a CUDA build of torch and run it on a GPU machine.\n"
        )
        sys.exit(2)


def _bench(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _check(name: str, err: float, tol: float) -> str:
    ok = err <= tol
    if not ok:
        FAILURES.append(f"{name}: {err:.2e} > {tol:.0e}")
    return f"{err:.2e} ({'ok' if ok else 'FAIL'}, tol {tol:.0e})"


def _sdpa(q, k, v, causal, scale):
    """SDPA on ``[s, b, h, d]`` tensors (it takes ``[b, h, s, d]``)."""
    bh = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*bh, is_causal=causal, scale=scale).permute(2, 0, 1, 3)


def parity(report: dict) -> None:
    from megatron_charm.kernels.backends import _KERNELS, available_kernels

    dev = torch.device("cuda")
    s, b, h, d = 1024, 2, 8, 128
    scale = d**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (
        torch.randn(s, b, h, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(4)
    )
    math = _KERNELS["math"]
    rows = {}
    for causal in (False, True):
        ref_o, ref_lse = math.forward(q.double(), k.double(), v.double(), causal, scale)
        ref_g = math.backward(
            do.double(), q.double(), k.double(), v.double(), ref_o, ref_lse, causal, scale
        )
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        so = _sdpa(qs, ks, vs, causal, scale)
        so.backward(do)
        sdpa_err = max(
            (a.double() - r.double()).abs().max().item()
            for a, r in zip((so, qs.grad, ks.grad, vs.grad), (ref_o, *ref_g), strict=True)
        )
        rows[f"sdpa causal={causal}"] = {"vs_fp64": sdpa_err}
        for name in [n for n in available_kernels(dev) if n != "math"]:
            kern = _KERNELS[name]
            o, lse = kern.forward(q, k, v, causal, scale)
            g = kern.backward(do, q, k, v, o, lse, causal, scale)
            err64 = max(
                (a.double() - r.double()).abs().max().item()
                for a, r in zip((o, *g), (ref_o, *ref_g), strict=True)
            )
            err_sdpa = max(
                (a.double() - r.double()).abs().max().item()
                for a, r in zip((o, *g), (so, qs.grad, ks.grad, vs.grad), strict=True)
            )
            lse_err = (lse.double() - ref_lse.permute(2, 0, 1).double()).abs().max().item()
            rows[f"{name} causal={causal}"] = {
                "vs_fp64": _check(f"{name} vs fp64", err64, 2 * sdpa_err + 1e-2),
                "vs_sdpa": err_sdpa,
                "lse_vs_fp64": _check(f"{name} lse", lse_err, 1e-2),
            }
    report["parity"] = rows


def speed(report: dict) -> None:
    from megatron_charm.kernels.backends import _KERNELS, available_kernels

    dev = torch.device("cuda")
    s, b, h, d = 8192, 2, 16, 128
    scale = d**-0.5
    q, k, v, do = (torch.randn(s, b, h, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
    rows = {}
    for causal in (False, True):
        flops = 4 * s * s * b * h * d * (0.5 if causal else 1.0)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        fwd = _bench(lambda qs=qs, ks=ks, vs=vs, c=causal: _sdpa(qs, ks, vs, c, scale))
        out = _sdpa(qs, ks, vs, causal, scale)
        bwd = _bench(
            lambda out=out, ins=(qs, ks, vs): torch.autograd.grad(out, ins, do, retain_graph=True)
        )
        rows[f"sdpa causal={causal}"] = _rates(fwd, bwd, flops)
        for name in [n for n in available_kernels(dev) if n != "math"]:
            kern = _KERNELS[name]
            fwd = _bench(lambda kern=kern, c=causal: kern.forward(q, k, v, c, scale))
            o, lse = kern.forward(q, k, v, causal, scale)
            bwd = _bench(
                lambda kern=kern, o=o, lse=lse, c=causal: kern.backward(
                    do, q, k, v, o, lse, c, scale
                )
            )
            rows[f"{name} causal={causal}"] = _rates(fwd, bwd, flops)
    report["speed"] = {"shape_sbhd": [s, b, h, d], "rows": rows}


def _rates(fwd_ms: float, bwd_ms: float, flops: float) -> dict:
    return {
        "fwd_ms": round(fwd_ms, 3),
        "bwd_ms": round(bwd_ms, 3),
        "fwd_tflops": round(flops / fwd_ms / 1e9, 1),
        "bwd_tflops": round(2.5 * flops / bwd_ms / 1e9, 1),
    }


def merge_bandwidth(report: dict) -> None:
    from megatron_charm.kernels.merge import merge_partial

    dev = torch.device("cuda")
    s, b, h, d = 8192, 2, 16, 128
    out = torch.randn(s, b, h, d, device=dev)
    lse = torch.randn(s, b, h, device=dev)
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        out_b = torch.randn(s, b, h, d, device=dev).to(dtype)
        lse_b = torch.randn(s, b, h, device=dev)
        ms = _bench(lambda out_b=out_b, lse_b=lse_b: merge_partial(out, lse, out_b, lse_b))
        # minimum traffic: read out, out_b, lse, lse_b; write out, lse
        nbytes = 2 * out.numel() * 4 + out_b.numel() * out_b.element_size() + 3 * lse.numel() * 4
        rows[str(dtype).replace("torch.", "")] = {
            "ms": round(ms, 3),
            "GB_s": round(nbytes / ms / 1e6),
        }
    report["merge"] = {"shape_sbhd": [s, b, h, d], "partial_dtype": rows}


def cp1(report: dict) -> None:
    import torch.distributed as dist

    import megatron_charm as mc
    from megatron_charm.plan import METHODS

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=120))
    try:
        topo = mc.CPTopology.build(None)
        dev = torch.device("cuda")
        b, s, h, h_kv, d = 2, 4096, 16, 4, 128
        scale = d**-0.5
        q, do = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(b, s, h_kv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
        ro = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (rq, rk, rv)), is_causal=True, scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)  # fmt: skip
        ro.backward(do)
        rows = {}
        for method in METHODS:
            lq, lk, lv = (t.clone().requires_grad_() for t in (q, k, v))

            def step(lq=lq, lk=lk, lv=lv, method=method):
                for t in (lq, lk, lv):
                    t.grad = None
                out = mc.cp_attention(lq, lk, lv, topo, method=method, causal=True)
                out.backward(do)
                return out

            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = step()
            peak = torch.cuda.max_memory_allocated() - base
            err = max(
                (a.double() - r.double()).abs().max().item()
                for a, r in zip(
                    (out, lq.grad, lk.grad, lv.grad), (ro, rq.grad, rk.grad, rv.grad), strict=True
                )
            )
            ms = _bench(step, iters=10)
            rows[method] = {
                "max_diff_vs_sdpa": _check(f"cp_attention {method}", err, 5e-2),
                "fwd_bwd_ms": round(ms, 3),
                "peak_extra_MiB": round(peak / 2**20, 1),
            }
        report["cp_attention_cp1"] = {"shape_bshd": [b, s, h, h_kv, d], "rows": rows}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    _require_cuda()
    t0 = time.time()
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import flash_attn

        report["flash_attn"] = flash_attn.__version__
    except ImportError:
        report["flash_attn"] = None
    for step in (parity, speed, merge_bandwidth, cp1):
        t = time.time()
        step(report)
        print(f"{step.__name__}: {time.time() - t:.1f} s", file=sys.stderr, flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    report["failures"] = FAILURES
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
