#!/usr/bin/env python3
"""Sweep the attention benchmark over shapes, link rates and testbed layouts (root, CPU).

    python scripts/bench/sweep.py --out docs/results/sweep [--only 2x2] [--dry-run]

Each point is one ``python -m megatron_charm.bench attention`` run on a fresh testbed; its JSON
lands in ``<out>/<point>.json``. ``scripts/bench/plot.py <out>`` draws the figures and the
table. Sized for a 2-core machine (about 15 minutes): small shapes, 3 timed iterations.
Run it again into another ``--out`` to repeat every point: ``python -m megatron_charm.sim.testbed
A/*.json B/*.json`` compares the runs of each point together (Note [Repeatability] in
``megatron_charm/sim/testbed.py``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (layout "mxp", topology, causal, batch, s_local, heads, cross rate)
POINTS = [
    *(
        ("2x2", "shared", True, 1, s, 4, r)
        for s in (512, 1024)
        for r in ("50mbit", "200mbit", "1gbit")
    ),
    ("2x2", "shared", True, 2, 512, 4, "200mbit"),
    ("2x2", "shared", True, 1, 512, 8, "200mbit"),
    *(("2x2", "shared", False, 1, 512, 4, r) for r in ("50mbit", "200mbit", "1gbit")),
    *(("2x4", "rails", True, 1, 512, 4, r) for r in ("100mbit", "400mbit", "2gbit")),
    *(("2x4", "rails", False, 1, 512, 4, r) for r in ("100mbit", "1gbit")),
    *(("4x2", "shared", True, 1, 512, 4, r) for r in ("100mbit", "500mbit")),
    ("4x2", "shared", False, 1, 512, 4, "200mbit"),
]


def point_name(p) -> str:
    lay, topo, causal, b, s, h, rate = p
    return f"{lay}-{topo}-{'causal' if causal else 'full'}-b{b}-s{s}-h{h}-{rate}"


def point_cmd(p, out_json: str, iters: int, methods: str) -> list[str]:
    lay, topo, causal, b, s, h, rate = p
    m, rpn = lay.split("x")
    return [
        sys.executable, "-m", "megatron_charm.bench", "attention",
        "--nodes", m, "--ranks-per-node", rpn, "--topology", topo, "--cross-rate", rate,
        "--batch", str(b), "--seq-local", str(s), "--heads", str(h), "--head-dim", "64",
        "--dtype", "bf16", "--causal" if causal else "--no-causal",
        "--methods", methods, "--iters", str(iters), "--warmup", "1",
        "--timeout", "300", "--quiet", "--json", out_json,
    ]  # fmt: skip


PEERS = "charm,ring,ring-flash,ring-flash-llama3,usp,all_gather,a2a,a2a+p2p,tasp".split(",")


def fitting(p, methods: list[str]) -> list[str]:
    """The methods of ``methods`` that can run point ``p``: the head splits need the heads to
    divide (a2a by the CP size; a2a+p2p, a2a+charm and usp by the ranks per node), TASP's
    chunks the local sequence, and the Llama 3 variant one sample per call."""
    lay, _, _, b, s, h, _ = p
    m, rpn = (int(x) for x in lay.split("x"))
    n = m * rpn
    skip = {
        "a2a": h % n != 0,
        "a2a+p2p": h % rpn != 0,
        "a2a+charm": h % rpn != 0,
        "usp": h % rpn != 0,
        "tasp": s % (2 * (n - 1)) != 0,
        "ring-flash-llama3": b != 1,
    }
    return [x for x in methods if not skip.get(x, False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "results", "sweep"))
    ap.add_argument("--only", default=None, help="run only points whose name contains this")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument(
        "--methods",
        default="charm,ring,ring-flash",
        help="comma list, or 'peers' for every method of the peers comparison; each point "
        "runs those that fit it",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=REPO)
    failed = []
    t_all = time.monotonic()
    for p in POINTS:
        name = point_name(p)
        if args.only and args.only not in name:
            continue
        out_json = os.path.join(args.out, name + ".json")
        wanted = PEERS if args.methods == "peers" else args.methods.split(",")
        cmd = point_cmd(p, out_json, args.iters, ",".join(fitting(p, wanted)))
        print(" ".join(cmd[1:]), flush=True)
        if args.dry_run:
            continue
        t0 = time.monotonic()
        rc = subprocess.call(cmd, env=env, cwd=REPO)
        print(f"  {name}: rc {rc}, {time.monotonic() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    print(f"sweep done in {time.monotonic() - t_all:.0f} s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
