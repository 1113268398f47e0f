#!/usr/bin/env python3
"""Figures and table of a sweep: CHARM+ speedup over ring attention against ring's CCR.

    python scripts/bench/plot.py docs/results/sweep [--png docs/results/sweep.png]
        [--md docs/results/sweep-table.md] [--winners] [--no-png]

``--winners`` adds the fastest method of each point, forward and forward+backward, among every
method the sweep ran, with charm's time over the fastest and how often charm is fastest or
within 5% of it.

Like the paper's Figures 6-8: one point per configuration; x is ring attention's CCR measured
sequentially (sum of compute over sum of communication), y the speedup of CHARM+ over ring
(filled) and over ring-flash-attention (hollow). Left panel forward, right forward+backward.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from megatron_charm.bench.report import emit

MARKERS = {"2x2": "o", "2x4": "s", "4x2": "^"}
MODES = ("fwd", "fwdbwd")


def load(folder: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            res = json.load(f)
        res["_name"] = os.path.splitext(os.path.basename(path))[0]
        rows.append(res)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| point | CCR fwd | CCR fwd+bwd | charm fwd ms | ring fwd ms | ring-flash fwd ms | "
        "speedup fwd (vs ring / vs ring-flash) | charm fwd+bwd ms | ring fwd+bwd ms | "
        "ring-flash fwd+bwd ms | speedup fwd+bwd (vs ring / vs ring-flash) | "
        "charm / bound fwd, fwd+bwd |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["methods"]

        def ms(name, mode, m=m):
            return f"{m[name][mode]['median'] * 1e3:.0f}" if name in m else "-"

        def sp(mode, m=m):
            c = m["charm"][mode]["median"]
            vs = [f"{m[b][mode]['median'] / c:.2f}" for b in ("ring", "ring-flash") if b in m]
            return " / ".join(vs)

        lines.append(
            f"| {r['_name']} | {r['ccr']['fwd']:.2f} | {r['ccr']['fwdbwd']:.2f} | "
            f"{ms('charm', 'fwd')} | {ms('ring', 'fwd')} | {ms('ring-flash', 'fwd')} | "
            f"{sp('fwd')} | "
            f"{ms('charm', 'fwdbwd')} | {ms('ring', 'fwdbwd')} | {ms('ring-flash', 'fwdbwd')} | "
            f"{sp('fwdbwd')} | {m['charm']['fwd']['bound_ratio']:.2f}, "
            f"{m['charm']['fwdbwd']['bound_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


#: charm within this factor of the fastest counts as "within 5%"
NEAR = 1.05


def winners(rows: list[dict]) -> str:
    """Per point, the fastest method of each pass (median times) and charm's time over it; a
    header counts the points where charm is fastest and where it is within :data:`NEAR`."""
    lines = [
        "| point | fastest fwd | charm / fastest fwd | fastest fwd+bwd | charm / fastest fwd+bwd |",
        "|---|---|---|---|---|",
    ]
    counts = {mode: [0, 0] for mode in MODES}
    for r in rows:
        cells = [r["_name"]]
        for mode in MODES:
            times = {k: v[mode]["median"] for k, v in r["methods"].items() if mode in v}
            best = min(times, key=times.__getitem__)
            ratio = times["charm"] / times[best]
            counts[mode][0] += best == "charm"
            counts[mode][1] += ratio <= NEAR
            cells += [best, f"{ratio:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    n = len(rows)
    head = [
        f"Fastest method per point ({n} points, median times, every method the sweep ran): "
        + "; ".join(
            f"{'forward' if mode == 'fwd' else 'forward+backward'}: charm fastest at "
            f"{counts[mode][0]}, within {NEAR - 1:.0%} of the fastest at {counts[mode][1]}"
            for mode in MODES
        )
        + ".",
        "",
    ]
    return "\n".join(head + lines) + "\n"


def plot(rows: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, mode, title in zip(
        axes, ("fwd", "fwdbwd"), ("forward", "forward + backward"), strict=True
    ):
        for r in rows:
            m = r["methods"]
            lay = "x".join(str(x) for x in r["layout"])
            causal = r["config"]["causal"]
            color = "tab:blue" if causal else "tab:orange"
            x = r["ccr"][mode]
            c = m["charm"][mode]["median"]
            ax.scatter(x, m["ring"][mode]["median"] / c, marker=MARKERS.get(lay, "o"), color=color)
            if "ring-flash" in m:
                ax.scatter(
                    x, m["ring-flash"][mode]["median"] / c, marker=MARKERS.get(lay, "o"),
                    facecolors="none", edgecolors=color,
                )  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("ring attention CCR (sequential compute / communication)")
        ax.set_ylabel("CHARM+ speedup")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles = [
        plt.Line2D([], [], marker=mk, ls="", color="k", label=f"{lay} testbed")
        for lay, mk in MARKERS.items()
    ] + [
        plt.Line2D([], [], marker="o", ls="", color="tab:blue", label="causal"),
        plt.Line2D([], [], marker="o", ls="", color="tab:orange", label="non-causal"),
        plt.Line2D([], [], marker="o", ls="", color="k", label="vs ring (filled)"),
        plt.Line2D(
            [], [], marker="o", ls="", mfc="none", color="k", label="vs ring-flash (hollow)"
        ),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--png", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--winners", action="store_true", help="add the fastest method per point")
    ap.add_argument("--no-png", action="store_true", help="write no figure")
    args = ap.parse_args(argv)
    rows = load(args.folder)
    if not rows:
        raise SystemExit(f"no sweep results (*.json) in {args.folder}")
    md = table(rows) + ("\n" + winners(rows) if args.winners else "")
    emit(md, args.md)
    if not args.no_png:
        plot(rows, args.png or args.folder.rstrip("/") + ".png")


if __name__ == "__main__":
    main()
