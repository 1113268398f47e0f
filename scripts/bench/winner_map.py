#!/usr/bin/env python3
"""Which CP method the simulator predicts fastest, over (CCR, heads per rank), per topology.

    python scripts/bench/winner_map.py --out-dir docs/results/winner-map

For each topology, the problem is one causal bf16 attention layer (batch 1, s_local 4096, head
dim 128, multi-head) on a GPU of the paper's Table 2 (its preset: peak TFLOPS at the fitted
efficiency, intra-node bandwidth and fabric). The x axis varies the cross-node bandwidth per
link, which sets ring attention's CCR (compute over communication time, forward; independent of
the head count for multi-head attention). The y axis is the query heads each CP rank holds (a
model's heads over its tensor-parallel size: 32 heads at TP 1 down to 1 at TP 32). Every method
a user can pick that can run the shape is replayed (``a2a`` needs the heads divisible by the CP
size, ``a2a+p2p`` by the ranks per node; the comparison methods of ``BASELINES``, such as
``a2a+charm``, are left out, as ``auto`` leaves them out); the winner has the lowest forward +
backward time. Writes
``<topology>.md`` (the grid, with charm's time over the winner's in every cell) and, with
matplotlib (``pip install -e .[plots]``), ``<topology>.png`` with CHARM+'s cells outlined.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from megatron_charm.plan import Layout, methods_for
from megatron_charm.plan.options import BASELINES
from megatron_charm.sim.predict import Problem, predict
from megatron_charm.sim.topology import PRESETS, Topology

S_LOCAL, HEAD_DIM = 4096, 128
HEADS = (1, 2, 4, 8, 16, 32)
CROSS_GBS = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0)
# name: (preset of the paper's Table 2, nodes, ranks per node, cross links per node)
TOPOLOGIES = {
    "h100-2x8-rails": ("H100", 2, 8, 8),
    "h100-2x8-2nics": ("H100", 2, 8, 2),
    "h100-2x8-shared": ("H100", 2, 8, 1),
    "h100-4x8-2nics": ("H100", 4, 8, 2),
    "l20-2x4-pcie-shared": ("L20", 2, 4, 1),
}
COLORS = {
    "charm": "#d62728",
    "ring": "#1f77b4",
    "ring-contig": "#aec7e8",
    "rm+": "#ff9896",
    "merge": "#ffbb78",
    "all_gather": "#2ca02c",
    "a2a": "#9467bd",
    "a2a+p2p": "#8c564b",
}


def cell(preset: str, m: int, p: int, nics: int, cross_gbs: float, heads: int) -> dict:
    hw = PRESETS[preset]
    topo = Topology(m, p, hw.intra_bw, cross_gbs, fabric=hw.fabric, nics_per_node=nics)
    compute = hw.compute_model()
    problem = Problem(1, S_LOCAL * m * p, heads, HEAD_DIM, causal=True)
    runnable = [
        x for x in methods_for(Layout(m, p), problem.shape(topo.cp_size)) if x not in BASELINES
    ]
    pred = predict(topo, problem, compute, runnable)
    times = {name: mp.total for name, mp in pred.methods.items()}
    winner = min(times, key=times.get)
    return {
        "cross_gbs": cross_gbs,
        "heads": heads,
        "ccr": pred.ccr_forward,
        "times_ms": {k: v * 1e3 for k, v in times.items()},
        "winner": winner,
        "charm_over_best": times["charm"] / times[winner],
    }


def markdown(name: str, cells: list[dict]) -> str:
    ccrs = {c["cross_gbs"]: c["ccr"] for c in cells}
    cols = sorted(ccrs)
    head = "| heads per rank | " + " | ".join(f"{g:g} GB/s (CCR {ccrs[g]:.2g})" for g in cols)
    lines = [head + " |", "|---" * (len(cols) + 1) + "|"]
    for h in sorted({c["heads"] for c in cells}, reverse=True):
        row = [c for c in cells if c["heads"] == h]
        by = {c["cross_gbs"]: c for c in row}
        entries = []
        for g in cols:
            c = by.get(g)
            if c is None:
                entries.append("-")
                continue
            mark = "**charm**" if c["winner"] == "charm" else c["winner"]
            tail = "" if c["winner"] == "charm" else f" (charm {c['charm_over_best']:.2f}x)"
            entries.append(mark + tail)
        lines.append(f"| {h} | " + " | ".join(entries) + " |")
    return "\n".join(lines) + "\n"


def plot(name: str, cells: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        return False
    cols = sorted({c["cross_gbs"] for c in cells})
    rows = sorted({c["heads"] for c in cells})
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for c in cells:
        x, y = cols.index(c["cross_gbs"]), rows.index(c["heads"])
        ax.add_patch(Rectangle((x, y), 1, 1, color=COLORS[c["winner"]]))
        if c["winner"] == "charm":
            ax.add_patch(Rectangle((x, y), 1, 1, fill=False, lw=2.5, ec="black"))
        else:
            ax.text(
                x + 0.5,
                y + 0.5,
                f"{c['charm_over_best']:.2f}",
                ha="center",
                va="center",
                fontsize=7,
            )
    ccrs = {c["cross_gbs"]: c["ccr"] for c in cells}
    ax.set_xlim(0, len(cols))
    ax.set_ylim(0, len(rows))
    ax.set_xticks([i + 0.5 for i in range(len(cols))])
    ax.set_xticklabels([f"{g:g}\n{ccrs[g]:.2g}" for g in cols], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(len(rows))])
    ax.set_yticklabels([str(h) for h in rows])
    ax.set_xlabel("cross-node GB/s per link / ring's forward CCR")
    ax.set_ylabel("query heads per rank")
    ax.set_title(
        f"{name}: fastest method (fwd+bwd), outlined = charm; numbers = charm / fastest", fontsize=9
    )
    winners = sorted({c["winner"] for c in cells})
    ax.legend(
        handles=[Patch(color=COLORS[w], label=w) for w in winners],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    for name in args.topologies.split(","):
        preset, m, p, nics = TOPOLOGIES[name]
        start = time.perf_counter()
        cells = [cell(preset, m, p, nics, g, h) for g in CROSS_GBS for h in HEADS]
        with open(os.path.join(args.out_dir, f"{name}.json"), "w") as f:
            json.dump(
                {"topology": name, "date": str(datetime.date.today()), "cells": cells}, f, indent=1
            )
        with open(os.path.join(args.out_dir, f"{name}.md"), "w") as f:
            f.write(markdown(name, cells))
        drawn = plot(name, cells, os.path.join(args.out_dir, f"{name}.png"))
        took = time.perf_counter() - start
        print(f"{name}: {took:.0f} s{'' if drawn else ' (no matplotlib: no PNG)'}", file=sys.stderr)


if __name__ == "__main__":
    main()
