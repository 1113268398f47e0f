"""Block-kernel time over block shapes on one GPU: what a CP step's kernel achieves as the block
shrinks (tiles of queries, waves over the SMs, the launch), and what its call costs the host.

For each head shape, batch and local sequence ``s`` it times one full ``s x s`` block (non-causal,
bf16, ``[s, b, h, d]`` inputs, our ``torch`` block kernel: FlashAttention-2 through ATen on CUDA,
the ``flash_attn`` one where installed) forward and backward with CUDA events (median of
``--iters``), and the host time of one call that is not synchronised (the enqueue). It prints a
table and writes JSON:

    python -m megatron_charm.bench.kernel_shapes --json kernel-shapes.json

``scripts/gpu_check.sh``'s ``speed`` check runs a smaller grid of the same cells
(:data:`GPU_CHECK_GRID`). On CPU (``--device cpu``, tiny shapes) it checks the code itself.
The simulator's compute model (docs/simulator.md, "Model") takes a fixed cost per call plus a
rate; these cells are what would pin both on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from megatron_charm.kernels import BlockKernel, select_kernel
from megatron_charm.sim.compute import BWD_FLOPS_RATIO
from megatron_charm.sim.profile import block_flops_full


def device_ms(fn: Callable[[], object], device: torch.device, iters: int = 10) -> float:
    """Median milliseconds of ``fn()`` on the device (wall time on CPU)."""
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
    return statistics.median(times)


def _host_us(fn, device: torch.device, iters: int) -> float:
    """Median host microseconds of one call that nobody waits for (the enqueue on CUDA)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def cell(
    kern: BlockKernel, s: int, b: int, h: int, d: int, device: torch.device, iters: int
) -> dict:
    """One block shape: ``q, k, v, dout`` of ``[s, b, h, d]``, bf16 on CUDA (fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v, do = (torch.randn(s, b, h, d, device=device, dtype=dtype) for _ in range(4))
    scale = d**-0.5
    flops = block_flops_full(b, h, d, s)

    def fwd():
        return kern.forward(q, k, v, False, scale)

    o, lse = fwd()

    def bwd():
        return kern.backward(do, q, k, v, o, lse, False, scale)

    f_ms, b_ms = device_ms(fwd, device, iters), device_ms(bwd, device, iters)
    return {
        "s": s, "b": b, "h": h, "d": d,
        "fwd_ms": round(f_ms, 4), "bwd_ms": round(b_ms, 4),
        "fwd_tflops": round(flops / f_ms / 1e9, 2),
        "bwd_tflops": round(BWD_FLOPS_RATIO * flops / b_ms / 1e9, 2),
        "fwd_host_us": round(_host_us(fwd, device, iters), 1),
        "bwd_host_us": round(_host_us(bwd, device, iters), 1),
    }  # fmt: skip


#: ``(heads x head dim, batches, local sequences)`` of the gpu_check's ``speed`` check: the
#: paper's Table 5 heads (12 x 192) and a common one (12 x 128), one and 16 sequences.
GPU_CHECK_GRID = (("12x192", "12x128"), (1, 16), (128, 256, 512, 1024, 2048, 4096))


def sweep(
    kern: BlockKernel,
    device: torch.device,
    heads: tuple[str, ...],
    batches: Sequence[int],
    seqs: Sequence[int],
    iters: int,
    max_tokens: int,
) -> Iterator[dict]:
    """Yield one row per shape (a dict from :func:`cell`, or ``{"error": ...}`` with the shape
    where the kernel refuses it)."""
    for hd in heads:
        h, d = (int(x) for x in hd.split("x"))
        for b in batches:
            for s in seqs:
                if b * s > max_tokens:
                    continue
                try:
                    yield cell(kern, s, b, h, d, device, iters)
                except Exception as exc:  # noqa: BLE001 - one shape the kernel refuses
                    yield {"s": s, "b": b, "h": h, "d": d, "error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--kernel", default="torch", help="block kernel name (torch, flash_attn)")
    ap.add_argument("--seqs", default="64,128,256,512,1024,2048,4096", help="local sequences")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--heads", default="12x192,12x128", help="heads x head dim, comma separated")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=65536, help="skip b x s above this")
    ap.add_argument("--json", dest="json_out")
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw_argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kern = select_kernel(device, dtype, args.kernel)
    rows = []
    print("| h x d | b | s | fwd ms | fwd TFLOPS | bwd ms | bwd TFLOPS | host us fwd / bwd |")
    print("|---|---|---|---|---|---|---|---|")
    batches = [int(x) for x in args.batches.split(",")]
    seqs = [int(x) for x in args.seqs.split(",")]
    heads = tuple(args.heads.split(","))
    for r in sweep(kern, device, heads, batches, seqs, args.iters, args.max_tokens):
        rows.append(r)
        head = f"| {r['h']}x{r['d']} | {r['b']} | {r['s']} |"
        if "error" in r:
            print(f"{head} failed: {r['error']} |", flush=True)
            continue
        print(
            f"{head} {r['fwd_ms']} | {r['fwd_tflops']} | {r['bwd_ms']} | {r['bwd_tflops']} "
            f"| {r['fwd_host_us']} / {r['bwd_host_us']} |",
            flush=True,
        )
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "kernel": kern.name,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python -m megatron_charm.bench.kernel_shapes", *raw_argv]),
        "rows": rows,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
