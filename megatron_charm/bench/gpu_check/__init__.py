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
6. ``cp4``: ``cp_attention`` in 4 processes on one device, every method, causal and full, GQA,
   2 nodes x 2 and 1 x 4, forward and backward, against float64 SDPA (:mod:`.cp4`).
7. ``calibrate``: ``megatron-charm-sim calibrate``'s measurements in 2 processes on the device
   (NCCL on CUDA, best effort), fitted into a profile that must be sane, load back and drive
   ``auto`` (:mod:`.calibrate_check`).
8. ``megatron``: megatron-core ``GPTModel`` with ``CharmDotProductAttention`` (local and, when
   Transformer Engine imports, TE layers), forward and backward against float64 attention per
   layer, then iterations of the trainer (:mod:`.megatron_check`).
9. ``overlap``: one CP = 4 step's time breakdown from the executor trace; on CUDA also the step
   with ``CUDA_DEVICE_MAX_CONNECTIONS`` 1 and 8 (recorded, not asserted; :mod:`.overlap`).

``--plant merge|kernel|destroy`` installs a planted bug in every spawned rank (``cp4``,
``megatron``, ``overlap``; not in this process, so a test may call :func:`main` in-process). It
exists for the tests that show the checks fail (:mod:`.plant`) and is not listed in ``--help``.

Exit status: 0 when every check passed, 1 on any failure, 2 when ``--device cuda`` has no CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from megatron_charm.bench.kernel_matrix import MatrixConfig

CHECKS = (
    "versions",
    "kernel_matrix",
    "merge",
    "speed",
    "cp1",
    "masked",
    "cp4",
    "calibrate",
    "megatron",
    "overlap",
)
NOT_IMPLEMENTED: dict[str, str] = {}


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

    def partial(self, name: str, result: dict) -> None:
        """Save what a running check has so far."""
        self.data["checks"][name] = result
        self.save()

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


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(x) for x in p.split("/")) for p in text.split(","))  # type: ignore[misc]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from megatron_charm.bench.gpu_check.cp4 import WORLD as CP4_RANKS
    from megatron_charm.bench.gpu_check.plant import PLANTS
    from megatron_charm.plan import METHODS
    from megatron_charm.plan.options import SEQ_LAYOUT_OF
    from megatron_charm.plan.tasp import check_tasp_shape

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
    ap.add_argument(
        "--cp-seq", type=int, default=None,
        help="cp4/overlap: local sequence per rank (default 768 CUDA, 24 CPU: divisible by 6, "
             "as tasp needs at CP 4)",
    )  # fmt: skip
    # ring-contig is not checked by default (contiguous shards; see docs/usage.md): its last
    # rank holds the rows with the smallest dk/dv, where the per-shard tolerance is tighter than
    # the fp32 merge noise every method has (about 1e-6 relative).
    ap.add_argument(
        "--methods", default=None,
        help="cp4: CP methods to check (default: every method but ring-contig; tasp only where "
             "--cp-seq is divisible by 6)",
    )  # fmt: skip
    ap.add_argument(
        "--cp4-transports", default=None,
        help="cp4: nccl,gloo-staged on CUDA (default), gloo on CPU (default), gloo-staged",
    )  # fmt: skip
    ap.add_argument(
        "--train-iters", type=int, default=None,
        help="megatron: trainer iterations (default 20 CUDA, 6 CPU; 0 skips the trainer)",
    )  # fmt: skip
    ap.add_argument("--plant", choices=PLANTS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = set(args.checks.split(",")) - set(CHECKS)
    if unknown:
        ap.error(f"--checks: unknown {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    if args.cp_seq is None:
        args.cp_seq = 768 if args.device == "cuda" else 24
    tasp_fits = args.cp_seq % (2 * (CP4_RANKS - 1)) == 0
    if args.methods is None:
        default = [m for m in METHODS if m not in SEQ_LAYOUT_OF and (m != "tasp" or tasp_fits)]
        args.methods = ",".join(default)
    bad_methods = set(args.methods.split(",")) - set(METHODS)
    if bad_methods:
        ap.error(f"--methods: unknown {sorted(bad_methods)}; choose from {', '.join(METHODS)}")
    if "tasp" in args.methods.split(","):
        try:
            check_tasp_shape(args.cp_seq, CP4_RANKS)
        except ValueError as exc:
            ap.error(f"--methods tasp with --cp-seq {args.cp_seq} (cp4 runs CP {CP4_RANKS}): {exc}")
    return args


def _run_check(name: str, args: argparse.Namespace, device: torch.device, report: Report):
    from megatron_charm.bench.gpu_check import single

    seq = args.seq or (1024 if device.type == "cuda" else 64)
    cp_seq = args.cp_seq
    methods = args.methods.split(",")
    if name == "versions":
        return single.versions(device), []
    if name == "kernel_matrix":
        cfg = MatrixConfig(
            seq=seq,
            batch=args.batch,
            dtypes=tuple(args.dtypes.split(",")),
            heads=_pairs(args.heads),
            head_dims=tuple(int(x) for x in args.head_dims.split(",")),
            blocks=tuple(args.blocks.split(",")),
        )
        return single.kernel_matrix(device, cfg, lambda r: report.partial(name, r))
    if name == "merge":
        return single.merge_check(device, 4 * seq)
    if name == "speed":
        return single.speed(device, 8 * seq)
    if name == "cp1":
        return single.cp1(device, seq)
    if name == "masked":
        from megatron_charm.bench.gpu_check.masked_check import masked_check

        return masked_check(device, 256 if device.type == "cuda" else 32)
    if name == "cp4":
        from megatron_charm.bench.gpu_check.cp4 import cp4

        default = "nccl,gloo-staged" if device.type == "cuda" else "gloo"
        transports = (args.cp4_transports or default).split(",")
        return cp4(device, transports, methods, cp_seq, args.plant,
                   lambda r: report.partial(name, r))  # fmt: skip
    if name == "calibrate":
        from megatron_charm.bench.gpu_check.calibrate_check import calibrate_check

        return calibrate_check(device, args.plant)
    if name == "megatron":
        from megatron_charm.bench.gpu_check.megatron_check import megatron_check

        iters = args.train_iters if args.train_iters is not None else (
            20 if device.type == "cuda" else 6)  # fmt: skip
        return megatron_check(device, iters, args.plant)
    from megatron_charm.bench.gpu_check.overlap import overlap

    # NCCL that did not run for cp4 (several processes on one GPU) is not tried again
    nccl = report.data["checks"].get("cp4", {}).get("transports", {}).get("nccl")
    try_nccl = nccl is None or bool(nccl.get("ran"))
    return overlap(device, cp_seq, args.plant, lambda r: report.partial(name, r), try_nccl)


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
    report = Report(args.json_out, device)
    report.save()
    selected = args.checks.split(",")
    t_all = time.time()
    for name in CHECKS:
        if name not in selected or (name == "speed" and device.type != "cuda"):
            continue
        t0 = time.time()
        try:
            result, bad = _run_check(name, args, device, report)
        except Exception as exc:  # noqa: BLE001 - report the crash, go on with the next check
            result, bad = {"error": f"{type(exc).__name__}: {exc}"}, [f"crashed: {exc}"]
        if isinstance(result, dict):
            result["seconds"] = round(time.time() - t0, 1)
        report.record(name, result, bad)
        status = "ok" if not bad else f"FAILED ({len(bad)})"
        print(
            f"gpu_check {name}: {status} in {time.time() - t0:.1f} s", file=sys.stderr, flush=True
        )
    from megatron_charm.bench.gpu_check.procs import close_pools

    close_pools()
    report.data["seconds"] = round(time.time() - t_all, 1)
    report.save()
    for f in report.data["failures"]:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if report.data["failures"] else 0
