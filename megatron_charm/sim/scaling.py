"""Scaling study: predicted speedup over ring vs number of nodes on H100-like links.

Weak scaling: every GPU holds ``--tokens-per-gpu`` tokens (global sequence = tokens x GPUs),
batch 1, causal, ``--gpus-per-node`` GPUs per node (default 8), the H100 preset's links (365.1
GB/s NVLink; cross links at the rate a transfer achieves in the paper's schedules, 0.62 of Table
2's 42.5 GB/s) with one per GPU, 2 or 1 cross links per node (rails, 2 NICs, shared), its enqueue
cost per operation, and 989 TFLOPS at ``--efficiency`` (default: the H100 preset's).

Run: ``python -m megatron_charm.sim.scaling --out-dir docs/results`` (writes sim_scaling.csv,
sim_scaling.md and sim_scaling.png; the PNG needs matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time
from dataclasses import dataclass

from megatron_charm.plan import METHODS, Layout, methods_for
from megatron_charm.plan.options import SEQ_LAYOUT_OF
from megatron_charm.sim.predict import Problem, one_node_note, predict
from megatron_charm.sim.programs import FULL_MODE_MAX_RANKS, SYMMETRIC_ERROR
from megatron_charm.sim.topology import PRESETS


@dataclass(frozen=True)
class ModelShape:
    """Attention shape of a GPT-3-like model (the GPT-3 sizes of docs/training.md, "Configs")."""

    name: str
    heads: int
    head_dim: int


SHAPES = (ModelShape("GPT-350M", 16, 64), ModelShape("GPT-1.3B", 16, 128))
NODES = (2, 4, 8, 16, 32, 64, 128)
# The cross links per node of p GPUs: one NIC per GPU, two per node (what the paper's timings
# imply, docs/results/sim_validation_paper.md), one shared link.
LINK_SETUPS = ("rails", "2 NICs", "shared")
# The columns of the markdown table (the CSV has every method).
SHOWN = ("charm", "rm+", "merge")


def nics_per_node(links: str, p: int) -> int:
    """Cross links per node of ``p`` GPUs in the setup named ``links`` (:data:`LINK_SETUPS`)."""
    return {"rails": p, "2 NICs": 2, "shared": 1}[links]


def setups(p: int) -> list[str]:
    """The setups of :data:`LINK_SETUPS` that differ on nodes of ``p`` GPUs (with 2 or 1 GPUs
    a node, one NIC per GPU is one of the others)."""
    out: list[str] = []
    for links in LINK_SETUPS:
        if all(nics_per_node(links, p) != nics_per_node(o, p) for o in out):
            out.append(links)
    return out


# The zigzag methods: causal ring-contig has no node symmetry, and replaying up to 1024 ranks in
# full would dominate the sweep (docs/simulator.md compares it at the paper's shapes).
SWEPT = tuple(m for m in METHODS if m not in SEQ_LAYOUT_OF)


def run(
    tokens_per_gpu: int, efficiency: float, nodes: tuple[int, ...] = NODES, p: int = 8
) -> list[dict]:
    """One row per (shape, cross links, nodes): times and speedups of every method."""
    hw = PRESETS["H100"]
    compute = hw.compute_model(efficiency)
    rows = []
    for shape in SHAPES:
        for links in setups(p):
            for m in nodes:
                topo = hw.topology(m, p, nics_per_node=nics_per_node(links, p))
                problem = Problem(
                    1, tokens_per_gpu * m * p, shape.heads, shape.head_dim, causal=True
                )
                start = time.process_time()
                layout = Layout(topo.num_nodes, topo.ranks_per_node)
                runnable = methods_for(layout, problem.shape(topo.cp_size))
                pred = predict(topo, problem, compute, tuple(m for m in SWEPT if m in runnable))
                row = {
                    "model": shape.name,
                    "cross_links": links,
                    "nodes": m,
                    "gpus": m * p,
                    "seq": problem.seq,
                    "ccr_fwd": round(pred.ccr_forward, 4),
                    "sim_cpu_s": round(time.process_time() - start, 2),
                }
                for method in SWEPT:
                    mp = pred.methods.get(method)
                    if mp is None:  # a2a: the heads do not split over this many GPUs
                        for col in ("fwd_ms", "bwd_ms", "fwd_x", "bwd_x"):
                            row[f"{method}_{col}"] = ""
                        continue
                    row[f"{method}_fwd_ms"] = round(mp.forward.makespan * 1e3, 3)
                    row[f"{method}_bwd_ms"] = round(mp.backward.makespan * 1e3, 3)
                    row[f"{method}_fwd_x"] = round(pred.speedup(method), 3)
                    row[f"{method}_bwd_x"] = round(pred.speedup(method, True), 3)
                rows.append(row)
                print(
                    f"{shape.name} {links} {m}x{p}: charm {row['charm_fwd_x']}x / "
                    f"{row['charm_bwd_x']}x ({row['sim_cpu_s']} s cpu)",
                    flush=True,
                )
    return rows


def _link_counts(p: int) -> str:
    """``"8, 2 or 1"``: the cross links per node of :func:`setups` on nodes of ``p`` GPUs."""
    counts = [str(nics_per_node(s, p)) for s in setups(p)]
    return counts[0] if len(counts) == 1 else ", ".join(counts[:-1]) + " or " + counts[-1]


def write_markdown(rows: list[dict], path: str, command: str, p: int = 8) -> None:
    today = datetime.date.today().isoformat()
    hw = PRESETS["H100"]
    lines = [
        "# Predicted CP attention speedup vs nodes (simulator)",
        "",
        f"Command: `{command}` ({today}). Plot: `sim_scaling.png`; all numbers: `sim_scaling.csv`.",
        "",
        "Speedup = ring time / method time for one attention layer (forward, backward), weak "
        f"scaling (fixed tokens per GPU), causal, batch 1, {p} GPUs per node, the H100 preset's "
        f"links ({hw.intra_bw} GB/s NVLink, {hw.cross_achieved:.2f} GB/s per cross link, the "
        f"rate Table 5's transfers achieve) with {_link_counts(p)} cross links per node, "
        f"{hw.enqueue.kernel * 1e6:g} us of host enqueue per operation, 989 TFLOPS at the given "
        f"efficiency. Groups above {FULL_MODE_MAX_RANKS} ranks (more than "
        f"{FULL_MODE_MAX_RANKS // p} nodes) replay one node under node symmetry "
        "(docs/simulator.md), which for causal attention is approximate: "
        f"{one_node_note({m: SYMMETRIC_ERROR[m] for m in SHOWN if m in SYMMETRIC_ERROR})} "
        "(SYMMETRIC_ERROR in megatron_charm/sim/programs.py). A step in a speedup between "
        f"{FULL_MODE_MAX_RANKS // p} and {2 * FULL_MODE_MAX_RANKS // p} nodes is that switch, "
        "not a property of the schedule.",
        "",
        "| model | cross links | nodes | seq | CCR fwd | ring fwd ms | charm fwd | rm+ fwd | "
        "merge fwd | ring bwd ms | charm bwd | rm+ bwd | merge bwd |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['cross_links']} | {r['nodes']} | {r['seq']} | {r['ccr_fwd']} | "
            f"{r['ring_fwd_ms']} | {r['charm_fwd_x']}x | {r['rm+_fwd_x']}x | {r['merge_fwd_x']}x"
            f" | {r['ring_bwd_ms']} | {r['charm_bwd_x']}x | {r['rm+_bwd_x']}x | "
            f"{r['merge_bwd_x']}x |"
        )
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def plot(rows: list[dict], path: str, p: int = 8) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5.4), sharey=True)
    styles = {"charm": "C0", "rm+": "C1", "merge": "C2"}
    for ax, shape in zip(axes, SHAPES, strict=True):
        for links, dash in zip(LINK_SETUPS, ("-", "--", ":"), strict=True):
            sel = [r for r in rows if r["model"] == shape.name and r["cross_links"] == links]
            xs = [r["nodes"] for r in sel]
            for method, color in styles.items():
                for tag, marker in (("fwd", "o"), ("bwd", "s")):
                    ax.plot(
                        xs,
                        [r[f"{method}_{tag}_x"] for r in sel],
                        dash,
                        color=color,
                        marker=marker,
                        ms=3,
                        label=f"{method} {tag} ({links})",
                    )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        nodes = sorted({r["nodes"] for r in rows})
        ax.set_xticks(nodes, [str(x) for x in nodes])
        ax.set_yticks(
            [1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8, 16],
            ["1/16", "1/8", "1/4", "1/2", "1", "2", "4", "8", "16"],
        )
        ax.set_ylim(1 / 20, 20)
        ax.set_xlabel(f"nodes (x{p} GPUs)")
        ax.set_title(f"{shape.name}-like ({shape.heads}x{shape.head_dim} heads)")
        ax.grid(True, which="both", lw=0.3)
    axes[0].set_ylabel("predicted speedup over ring")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=6, loc="lower center")
    fig.suptitle("CP attention on H100-like links (simulated; causal, weak scaling)", fontsize=10)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=130)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-gpu", type=int, default=4096)
    ap.add_argument("--efficiency", type=float, default=PRESETS["H100"].efficiency)
    ap.add_argument("--nodes", default=",".join(map(str, NODES)))
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args(argv)
    nodes = tuple(int(x) for x in args.nodes.split(","))
    if args.gpus_per_node < 1:
        ap.error(f"--gpus-per-node {args.gpus_per_node}: a node holds at least one GPU")
    p = args.gpus_per_node
    rows = run(args.tokens_per_gpu, args.efficiency, nodes, p)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "sim_scaling.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    command = (
        f"python -m megatron_charm.sim.scaling --tokens-per-gpu {args.tokens_per_gpu} "
        f"--efficiency {args.efficiency} --nodes {args.nodes} --gpus-per-node {p} "
        "--out-dir docs/results"
    )
    write_markdown(rows, os.path.join(args.out_dir, "sim_scaling.md"), command, p)
    try:
        plot(rows, os.path.join(args.out_dir, "sim_scaling.png"), p)
    except ModuleNotFoundError as err:
        print(
            f"sim_scaling.png not written ({err}); pip install -e '.[plots]' for the plot",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
