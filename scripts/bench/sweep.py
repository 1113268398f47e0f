#!/usr/bin/env python3
"""Sweep the attention benchmark over shapes, link rates and testbed layouts (root, CPU).

    python scripts/bench/sweep.py --out docs/results/sweep [--only 2x2] [--dry-run]

Each point is one ``python -m megatron_charm.bench attention`` run on a fresh testbed; its JSON
lands in ``<out>/<point>.json``. ``scripts/bench/plot.py <out>`` draws the figures and the
table. Sized for a 2-core machine (about 18 minutes): small shapes, 3 timed iterations; multi-head
points, and three grouped-query ones (``-kv2`` in their names; ``--only kv`` runs just those).
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
from typing import NamedTuple

from megatron_charm.sim.predict import SIMPLICITY

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Point(NamedTuple):
    """One sweep point: a testbed layout, its links and an attention shape."""

    layout: str  # "MxP": nodes x ranks per node
    topology: str  # "shared" or "rails" cross links
    causal: bool
    batch: int
    seq_local: int  # tokens per rank
    heads: int
    rate: str  # tc rate of the cross links
    kv_heads: int = 0  # 0: as many as heads (multi-head attention)


# Kv heads of the grouped-query points: 8 query heads share 2, as in Llama-style models, so charm
# ships kv across nodes there instead of q (cross_level="auto"), a case its defaults choose.
GQA_KV_HEADS = 2

POINTS = [
    *(
        Point("2x2", "shared", True, 1, s, 4, r)
        for s in (512, 1024)
        for r in ("50mbit", "200mbit", "1gbit")
    ),
    Point("2x2", "shared", True, 2, 512, 4, "200mbit"),
    Point("2x2", "shared", True, 1, 512, 8, "200mbit"),
    *(Point("2x2", "shared", False, 1, 512, 4, r) for r in ("50mbit", "200mbit", "1gbit")),
    *(Point("2x4", "rails", True, 1, 512, 4, r) for r in ("100mbit", "400mbit", "2gbit")),
    *(Point("2x4", "rails", False, 1, 512, 4, r) for r in ("100mbit", "1gbit")),
    *(Point("4x2", "shared", True, 1, 512, 4, r) for r in ("100mbit", "500mbit")),
    Point("4x2", "shared", False, 1, 512, 4, "200mbit"),
    Point("2x2", "shared", True, 1, 512, 8, "200mbit", GQA_KV_HEADS),
    Point("2x4", "rails", True, 1, 512, 8, "400mbit", GQA_KV_HEADS),
    Point("4x2", "shared", True, 1, 512, 8, "100mbit", GQA_KV_HEADS),
]


def point_name(p: tuple) -> str:
    p = Point(*p)
    kv = f"-kv{p.kv_heads}" if p.kv_heads else ""
    causal = "causal" if p.causal else "full"
    return f"{p.layout}-{p.topology}-{causal}-b{p.batch}-s{p.seq_local}-h{p.heads}{kv}-{p.rate}"


def point_cmd(p: tuple, out_json: str, iters: int, methods: str) -> list[str]:
    p = Point(*p)
    m, rpn = p.layout.split("x")
    return [
        sys.executable, "-m", "megatron_charm.bench", "attention",
        "--nodes", m, "--ranks-per-node", rpn, "--topology", p.topology, "--cross-rate", p.rate,
        "--batch", str(p.batch), "--seq-local", str(p.seq_local), "--heads", str(p.heads),
        "--kv-heads", str(p.kv_heads or p.heads), "--head-dim", "64",
        "--dtype", "bf16", "--causal" if p.causal else "--no-causal",
        "--methods", methods, "--iters", str(iters), "--warmup", "1",
        "--timeout", "300", "--quiet", "--json", out_json,
    ]  # fmt: skip


PEERS = "charm,ring,ring-flash,ring-flash-llama3,usp,all_gather,a2a,a2a+p2p,tasp".split(",")

#: The methods ``auto`` chooses among (:data:`megatron_charm.sim.predict.SIMPLICITY`), so that
#: its pick is measured at every point (``testbed`` compares it with the measured fastest).
AUTO = list(SIMPLICITY)


def wanted_methods(spec: str) -> list[str]:
    """``--methods``: a comma list in which ``peers`` stands for :data:`PEERS` and ``auto`` for
    :data:`AUTO`; each method once, in first-seen order."""
    out: list[str] = []
    for name in spec.split(","):
        out += PEERS if name == "peers" else AUTO if name == "auto" else [name]
    return list(dict.fromkeys(out))


def fitting(p: tuple, methods: list[str]) -> list[str]:
    """The methods of ``methods`` that can run point ``p``: the head splits need the query and
    kv heads to divide (a2a by the CP size; a2a+p2p, a2a+charm and usp by the ranks per node),
    TASP's chunks the local sequence, and the Llama 3 variant one sample per call."""
    p = Point(*p)
    m, rpn = (int(x) for x in p.layout.split("x"))
    n = m * rpn
    kv = p.kv_heads or p.heads

    def splits(ways: int) -> bool:
        return p.heads % ways == 0 and kv % ways == 0

    skip = {
        "a2a": not splits(n),
        "a2a+p2p": not splits(rpn),
        "a2a+charm": not splits(rpn),
        "usp": not splits(rpn),
        "tasp": p.seq_local % (2 * (n - 1)) != 0,
        "ring-flash-llama3": p.batch != 1,
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
        help="comma list, in which 'peers' stands for every method of the peers comparison and "
        "'auto' for every method auto chooses among (peers,auto: both); each point runs those "
        "that fit it",
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
        wanted = wanted_methods(args.methods)
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
