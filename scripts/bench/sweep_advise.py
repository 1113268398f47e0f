#!/usr/bin/env python3
"""What ``megatron-charm-sim advise`` recommends at each point of a measured sweep.

    python scripts/bench/sweep_advise.py docs/results/sweep \\
        --profile docs/results/calibrate/profile-2x2-shared-100mbit.json [--md FILE]

For every JSON that ``scripts/bench/sweep.py`` wrote, runs ``advise`` between charm and ring on
the point's layout, link kind and problem, with the profile's compute and intra-node model and
the point's cross-link rate, and sets it beside the measured speedup of charm over the faster of
ring and ring-flash-attention. A point where charm measured slower and ``advise`` still picks it
is a point where the advice is wrong.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys


def advise(res: dict, profile: str) -> str:
    cfg = res["config"]
    m, p = res["layout"]
    cmd = [
        sys.executable,
        "-m",
        "megatron_charm.sim",
        "advise",
        "--profile",
        profile,
        "--gpus",
        f"{m}x{p}",
        "--cross-links",
        cfg["topology"],
        "--cross-bw",
        str(res["cross_bps"] / 8e9),
        "--batch",
        str(cfg["batch"]),
        "--seq",
        str(cfg["seq_local"] * m * p),
        "--heads",
        str(cfg["heads"]),
        "--kv-heads",
        str(cfg["kv_heads"]),
        "--head-dim",
        str(cfg["head_dim"]),
        "--methods",
        "charm,ring",
        "--json",
    ]
    if cfg["causal"]:
        cmd.append("--causal")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["cp_comm_type"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    lines = [
        "| point | charm fwd+bwd speedup (measured, over the faster ring) | advise picks "
        "| advice |",
        "|---|---|---|---|",
    ]
    for path in sorted(glob.glob(os.path.join(args.folder, "*.json"))):
        with open(path) as f:
            res = json.load(f)
        speedup = res["methods"]["charm"]["fwdbwd"]["speedup_vs_best_baseline"]
        pick = advise(res, args.profile)
        right = (pick == "charm") == (speedup >= 1.0)
        name = os.path.splitext(os.path.basename(path))[0]
        verdict = "right" if right else "**wrong**"
        lines.append(f"| {name} | {speedup:.2f}x | {pick} | {verdict} |")
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
