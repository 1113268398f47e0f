"""``megatron-charm-bench attention``: launch the ranks, collect, summarise, write JSON + markdown.

Launchers:

* ``testbed`` (default): an emulated ``m x p`` machine (:mod:`megatron_charm.testbed`, root).
* ``loopback``: ``m * p`` local gloo processes on 127.0.0.1; node identities are set so the
  layout is still ``m x p``, but every link is loopback (no slow cross link, no bound).
* ``env``: already launched by torchrun/srun (``RANK``, ``WORLD_SIZE``, ``MASTER_*``); use
  ``--device cuda`` for NCCL on a GPU cluster. Node detection then uses host names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from megatron_charm import env
from megatron_charm.bench.methods import BASELINES, OURS
from megatron_charm.bench.provenance import git, host
from megatron_charm.bench.summary import markdown, summarise
from megatron_charm.constants import DEFAULT_TIMEOUT_S
from megatron_charm.plan.options import add_plan_arguments, plan_values_from_args

REPO_ROOT = str(Path(__file__).resolve().parents[2])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--launcher", choices=("testbed", "loopback", "env"), default="testbed")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--topology", choices=("shared", "rails"), default="shared")
    ap.add_argument("--cross-rate", default="100mbit", help="tc rate, e.g. 100mbit (testbed)")
    ap.add_argument("--preset", default=None, help="l20|h20|h100 instead of --cross-rate")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-local", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--methods",
        default="charm,rm+,merge,ring,ring-flash",
        help=f"comma list of {','.join(OURS + BASELINES)}",
    )
    ap.add_argument(
        "--docs",
        default=None,
        help="documents packed into the global sequence: LENxCOUNT (e.g. 2048x8) or "
        "comma-separated lengths; their sum is the global sequence length",
    )
    ap.add_argument(
        "--mask-window",
        type=int,
        default=None,
        help="sliding window: tokens to the left (right 0 when causal, the same otherwise)",
    )
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    add_plan_arguments(ap)
    ap.add_argument("--kernel", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--timeout",
        type=float,
        default=2 * DEFAULT_TIMEOUT_S,
        help="seconds for the whole run (default: twice the collective timeout)",
    )
    ap.add_argument("--json", dest="json_out", default=None, help="write the result JSON here")
    ap.add_argument("--md", dest="md_out", default=None, help="write the markdown table here")
    ap.add_argument("--raw", dest="raw_out", default=None, help="keep the per-rank raw JSON")
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also compare every method with float64 attention on the whole sequence (small sizes)",
    )
    ap.add_argument("--quiet", action="store_true")


def parse_docs(text: str | None) -> list[int] | None:
    """``LENxCOUNT`` or comma-separated lengths -> document lengths (``None`` for no text)."""
    if not text:
        return None
    try:
        if "x" in text:
            length, count = (int(x) for x in text.split("x"))
            lens = [length] * count
        else:
            lens = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--docs {text!r}: expected LENxCOUNT (e.g. 2048x8) or comma-separated lengths"
        ) from None
    if not lens or min(lens) < 1:
        raise ValueError(f"--docs {text!r}: every document needs at least one token")
    return lens


def config_from_args(args: argparse.Namespace) -> dict:
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in OURS + BASELINES]
    if bad or not methods:
        raise ValueError(
            f"--methods {args.methods!r}: unknown {bad}; choose from {', '.join(OURS + BASELINES)}"
        )
    for flag in ("seq_local", "batch", "heads", "kv_heads", "head_dim", "iters"):
        value = getattr(args, flag)
        if value is not None and value < 1:  # --kv-heads None: as many as --heads
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be >= 1")
    if args.causal and args.seq_local % 2:
        raise ValueError(f"--seq-local {args.seq_local} must be even for causal (zigzag halves)")
    docs = parse_docs(args.docs)
    if (docs or args.mask_window is not None) and args.reference:
        raise ValueError(
            "--reference compares with dense attention; with --docs / --mask-window the float64 "
            "check is the gloo test tier's (tests/gloo/test_masks.py); drop --reference"
        )
    if args.mask_window is not None and args.mask_window < 0:
        raise ValueError(f"--mask-window {args.mask_window} must be >= 0")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"--iters {args.iters} must be >= 1 and --warmup {args.warmup} >= 0")
    return {
        "methods": methods,
        "batch": args.batch,
        "seq_local": args.seq_local,
        "heads": args.heads,
        "kv_heads": args.heads if args.kv_heads is None else args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "causal": args.causal,
        "docs": docs,
        "mask_window": args.mask_window,
        "iters": args.iters,
        "warmup": args.warmup,
        "seed": args.seed,
        **plan_values_from_args(args),
        "kernel": args.kernel,
        "device": args.device,
        "topology": args.topology,
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "timeout_s": args.timeout,
        "reference": args.reference,
    }


def _worker_cmd(cfg_path: str, module: str = "megatron_charm.bench") -> list[str]:
    return [sys.executable, "-m", module, "worker", cfg_path]


def _env() -> dict[str, str]:
    from megatron_charm.launch import package_pythonpath

    return {"PYTHONPATH": package_pythonpath()}


def run_loopback(cfg: dict, cfg_path: str, module: str = "megatron_charm.bench") -> None:
    """Run ``python -m <module> worker CFG`` as ``nodes x ranks_per_node`` local gloo ranks whose
    node identities give that layout (every link is loopback)."""
    from megatron_charm.launch import LaunchError, LaunchSpec, run

    p = cfg["ranks_per_node"]
    cfg["cross_bps"] = 0
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    spec = LaunchSpec(
        cmd=_worker_cmd(cfg_path, module),
        nproc=cfg["nodes"] * p,
        timeout_s=cfg["timeout_s"],
        env=_env(),
        rank_env=lambda r: {
            "LOCAL_RANK": str(r % p),
            "MEGATRON_CHARM_NODE_ID": f"loopback-n{r // p}",
        },
    )
    why = run(spec).error()
    if why is not None:
        raise LaunchError(f"{module} worker {why}")


def run_testbed(
    cfg: dict, cfg_path: str, args: argparse.Namespace, module: str = "megatron_charm.bench"
) -> dict:
    """Run ``python -m <module> worker CFG`` on an emulated testbed built from ``args``
    (``nodes``, ``ranks_per_node``, ``topology``, ``cross_rate`` or ``preset``); returns the
    testbed's description."""
    from megatron_charm.testbed import Testbed

    kw = {"preset": args.preset} if args.preset else {"cross_rate": args.cross_rate}
    with Testbed(
        nodes=args.nodes, ranks_per_node=args.ranks_per_node, topology=args.topology, **kw
    ) as tb:
        cfg["cross_bps"] = tb.cross_rate_bps
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        cmd = _worker_cmd(cfg_path, module)
        res = tb.run(cmd, timeout_s=cfg["timeout_s"], env=_env(), capture=True)
        if not getattr(args, "quiet", False):
            for r in res.ranks:
                if r.returncode != 0 and r.stderr:
                    sys.stderr.write(f"--- rank {r.global_rank} stderr ---\n{r.stderr[-4000:]}\n")
        res.check()
        return tb.describe()


def code_version() -> dict[str, str | None]:
    """The git commit of the tree and a digest of the planner and executor sources as they are on
    disk (the working tree may differ from the commit), so a result can be traced to its code."""
    import hashlib

    pkg = Path(REPO_ROOT) / "megatron_charm"
    digest = hashlib.sha256()
    for path in sorted([*pkg.glob("plan/*.py"), *pkg.glob("comm/*.py"), pkg / "function.py"]):
        digest.update(path.name.encode() + path.read_bytes())
    return {"git_commit": git("rev-parse", "HEAD"), "plan_comm_sha256": digest.hexdigest()[:16]}


def run_attention(args: argparse.Namespace) -> dict:
    """Run the benchmark as configured by ``args``; returns the summarised result."""
    from datetime import datetime, timezone

    cfg = config_from_args(args)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    version = code_version()
    tmp = tempfile.mkdtemp(prefix="mc-bench-")
    cfg_path = os.path.join(tmp, "config.json")
    cfg["raw_out"] = args.raw_out or os.path.join(tmp, "raw.json")
    testbed = None
    if args.launcher == "env":
        from megatron_charm.bench.worker import run

        cfg["cross_bps"] = env.testbed_cross_bps()
        raw = run(cfg)
        if raw is None:
            return {}
    else:
        if args.launcher == "testbed":
            testbed = run_testbed(cfg, cfg_path, args)
        else:
            run_loopback(cfg, cfg_path)
        with open(cfg["raw_out"]) as f:
            raw = json.load(f)
    res = summarise(raw, cfg)
    res["config"] = {k: v for k, v in cfg.items() if k not in ("raw_out",)}
    res["launcher"] = args.launcher
    res["date"] = started
    res["shim_max_diff"] = raw.get("shim_max_diff")
    res["code"] = version
    res["host"] = host()
    if testbed is not None:
        res["testbed"] = {k: testbed[k] for k in ("config", "cross_rate_bps", "intra_rate_bps")}
    md = markdown(res, cfg)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
    if args.md_out:
        with open(args.md_out, "w") as f:
            f.write(md)
    if not args.quiet:
        print(md)
    return res
