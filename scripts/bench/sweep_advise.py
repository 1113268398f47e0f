#!/usr/bin/env python3
"""What ``megatron-charm-sim advise`` recommends at each point of a measured sweep.

    python scripts/bench/sweep_advise.py docs/results/sweep \\
        --profile docs/results/calibrate/profile-2x2-shared-100mbit.json [--md FILE]
    python scripts/bench/sweep_advise.py docs/results/sweep-peers --profile P \\
        --methods charm,ring,all_gather,a2a,a2a+p2p [--md FILE]

For every JSON that ``scripts/bench/sweep.py`` wrote, runs ``advise`` on the point's layout, link
kind and problem, with the profile's compute and intra-node model and the point's cross-link
rate. With the default ``--methods charm,ring`` it sets the pick beside the measured speedup of
charm over the faster of ring and ring-flash-attention: a point where charm measured slower and
``advise`` still picks it is a point where the advice is wrong. With more methods (those of the
planner that the point's JSON measured), the pick is right when its measured forward+backward
time is within 5% of the fastest of those methods, which is what ``--cp-comm-type auto`` promises.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

from megatron_charm.bench.report import emit


def advise(res: dict, profile: str, methods: list[str]) -> str:
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
        ",".join(methods),
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
    ap.add_argument("--methods", default="charm,ring")
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    wanted = args.methods.split(",")
    pair = wanted == ["charm", "ring"]
    if pair:
        head = "| point | charm fwd+bwd speedup (measured, over the faster ring) | advise picks "
        lines = [head + "| advice |", "|---|---|---|---|"]
    else:
        lines = [
            "| point | candidates | measured fastest (fwd+bwd ms) | advise picks (ms) | advice |",
            "|---|---|---|---|---|",
        ]
    right_count = total = 0
    for path in sorted(glob.glob(os.path.join(args.folder, "*.json"))):
        with open(path) as f:
            res = json.load(f)
        name = os.path.splitext(os.path.basename(path))[0]
        if pair:
            speedup = res["methods"]["charm"]["fwdbwd"]["speedup_vs_best_baseline"]
            pick = advise(res, args.profile, wanted)
            right = (pick == "charm") == (speedup >= 1.0)
            verdict = "right" if right else "**wrong**"
            lines.append(f"| {name} | {speedup:.2f}x | {pick} | {verdict} |")
        else:
            measured = {
                m: res["methods"][m]["fwdbwd"]["median"] for m in wanted if m in res["methods"]
            }
            pick = advise(res, args.profile, list(measured))
            best = min(measured, key=measured.get)
            right = measured[pick] <= 1.05 * measured[best]
            verdict = "right" if right else f"**wrong** ({measured[pick] / measured[best]:.2f}x)"
            lines.append(
                f"| {name} | {len(measured)} | {best} ({measured[best] * 1e3:.0f}) "
                f"| {pick} ({measured[pick] * 1e3:.0f}) | {verdict} |"
            )
        right_count += right
        total += 1
    lines += ["", f"Right at {right_count} of {total} points."]
    text = "\n".join(lines)
    emit(text, args.md)


if __name__ == "__main__":
    main()
