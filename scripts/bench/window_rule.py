"""Plan option defaults from a sweep: the prefetch window (predicted time and planned memory per
window) and ``combine_nodes``.

``PlanOptions.window`` is how many exchanges each channel of CHARM+'s pipelines keeps in flight.
For every point of a grid (hardware preset, node layout, heads, tokens per rank; causal, bf16) this
replays charm's plans in the simulator at each window and computes their attention memory with the
planner's replay (Note [Memory of a pass]). The rule it checks: the default is the smallest window
whose predicted forward+backward is within ``--tolerance`` of the best window's at every point,
since a larger window can only hold more buffers.

    python scripts/bench/window_rule.py --md docs/results/window-rule.md
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from datetime import datetime, timezone

from megatron_charm.bench.report import emit
from megatron_charm.plan import AttnShape, Layout, PlanOptions, build_plan
from megatron_charm.plan.memory import plan_peak
from megatron_charm.sim.compute import FlopsCompute
from megatron_charm.sim.predict import Problem, predict
from megatron_charm.sim.topology import PRESETS, Topology

GRID = {"H100": ((2, 4), (2, 8), (4, 8)), "L20": ((2, 4), (2, 2))}
HEADS = ((32, 32), (32, 8))  # (query heads, kv heads), head dim 128
TOKENS = (2048, 8192)


def grid() -> Iterator[tuple[str, Layout, Topology, FlopsCompute, int, int, int]]:
    """Every point: (hardware, layout, topology, compute model, heads, kv heads, tokens)."""
    for name, layouts in GRID.items():
        hw = PRESETS[name]
        compute = hw.compute_model()
        for m, p in layouts:
            topo = hw.topology(m, p)
            for h, h_kv in HEADS:
                for tokens in TOKENS:
                    yield name, Layout(m, p), topo, compute, h, h_kv, tokens


def charm_time(topo: Topology, compute: FlopsCompute, h: int, h_kv: int, tokens: int, **opts):
    """charm's predicted forward+backward (seconds) with plan options ``opts``."""
    problem = Problem(1, tokens * topo.cp_size, h, 128, kv_heads=h_kv, causal=True)
    pred = predict(topo, problem, compute, ("charm",), options=PlanOptions(**opts))
    return pred.methods["charm"].total


def memory(layout: Layout, shape: AttnShape, **opts) -> int:
    """Attention memory of the largest rank (planner replay) with plan options ``opts``."""
    return plan_peak(build_plan(PlanOptions(**opts), layout, True, shape), shape)


def combine_table() -> tuple[list[str], list[float]]:
    """Markdown rows and the fwd+bwd ratios of ``combine_nodes=True`` over ``False`` on the
    grid's layouts of two or more nodes."""
    lines = ["| hardware | m x p | heads (kv) | tokens per rank | fwd+bwd, True over False |"]
    lines.append("|---|---|---|---|---|")
    ratios = []
    for name, layout, topo, compute, h, h_kv, tokens in grid():
        if layout.num_nodes < 2:
            continue
        t = {c: charm_time(topo, compute, h, h_kv, tokens, combine_nodes=c) for c in (False, True)}
        ratios.append(t[True] / t[False])
        m, p = layout.num_nodes, layout.ranks_per_node
        lines.append(f"| {name} | {m} x {p} | {h} ({h_kv}) | {tokens} | {ratios[-1]:.3f} |")
    return lines, ratios


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default="1,2,3,4")
    ap.add_argument("--tolerance", type=float, default=0.01, help="relative time tie (0.01 = 1%%)")
    ap.add_argument("--md", help="write the table here")
    args = ap.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = " | ".join(f"w{w}: time, memory" for w in windows)
    lines = [
        f"| hardware | m x p | heads (kv) | tokens per rank | {head} |",
        "|---|---|---|---|" + "---|" * len(windows),
    ]
    worst = dict.fromkeys(windows, 1.0)
    for name, layout, topo, compute, h, h_kv, tokens in grid():
        times = {w: charm_time(topo, compute, h, h_kv, tokens, window=w) for w in windows}
        best = min(times.values())
        shape = AttnShape(1, tokens, h, h_kv, 128, 2)
        ring = memory(layout, shape, method="ring")
        cells = []
        for w in windows:
            worst[w] = max(worst[w], times[w] / best)
            cells.append(f"{times[w] / best:.3f}, {memory(layout, shape, window=w) / ring:.2f}x")
        m, p = layout.num_nodes, layout.ranks_per_node
        lines.append(
            f"| {name} | {m} x {p} | {h} ({h_kv}) | {tokens} | " + " | ".join(cells) + " |"
        )
    chosen = min(w for w in windows if worst[w] <= 1 + args.tolerance)
    combine_lines, combine_ratios = combine_table()
    summary = (
        "Worst time over the best window's, per window: "
        + ", ".join(f"w{w} {worst[w]:.3f}" for w in windows)
        + f". Smallest window within {args.tolerance:.0%} everywhere: **{chosen}** "
        f"(the default is {PlanOptions().window})."
    )
    text = "\n".join(
        [
            f"Generated {started} by `python scripts/bench/window_rule.py`. Time: predicted "
            "forward+backward over the best window's at that point; memory: charm's attention "
            "memory over ring attention's (planner replay, largest rank).",
            "",
            *lines,
            "",
            summary,
            "",
            "`combine_nodes=True` (Algorithm 2: queries cross whole, one step a source node) "
            "against the default `False`, predicted forward+backward, same grid on every layout "
            "of two or more nodes:",
            "",
            *combine_lines,
            "",
            f"True over False: {min(combine_ratios):.3f}-{max(combine_ratios):.3f}; it is faster "
            f"by more than {args.tolerance:.0%} at "
            f"{sum(r < 1 - args.tolerance for r in combine_ratios)} of {len(combine_ratios)} "
            f"points (the default is {PlanOptions().combine_nodes}).",
            "",
        ]
    )
    emit(text, args.md)


if __name__ == "__main__":
    main()
