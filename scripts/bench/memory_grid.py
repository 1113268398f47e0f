"""Attention memory of CHARM+ against ring attention over node layouts and kv head counts.

The planner's replay of every rank's programs (Note [Memory of a pass] in
``megatron_charm/plan/memory.py``), which the gloo tier checks against the executor's own count:
no kernel runs, so the grid covers layouts that this machine cannot run. Per rank, one attention
layer: the larger of the forward's peak buffers and the backward's plus the saved out and lse;
the largest rank's.

    python scripts/bench/memory_grid.py --layouts 2x4,2x8,4x8,1x8 --kv-heads 16,4,1
"""

from __future__ import annotations

import argparse

from megatron_charm.plan import AttnShape, Layout, PlanOptions, build_plan
from megatron_charm.plan.memory import plan_peak


def peak(options: PlanOptions, layout: Layout, shape: AttnShape) -> int:
    return plan_peak(build_plan(options, layout, True, shape), shape)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="2x4,2x8,4x8,1x8")
    ap.add_argument("--kv-heads", default="16,4,1")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--s-local", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--budgets", default="1.1,10", help="memory_budget values to show")
    args = ap.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    head = " | ".join(f"charm, budget {b:g}: levels, x ring" for b in budgets)
    print(f"| m x p | kv heads | ring MiB | {head} |")
    print("|---|---|---|" + "---|" * len(budgets))
    for spec in args.layouts.split(","):
        m, p = (int(x) for x in spec.split("x"))
        layout = Layout(m, p)
        for h_kv in (int(x) for x in args.kv_heads.split(",")):
            shape = AttnShape(1, args.s_local, args.heads, h_kv, args.head_dim, 2)
            ring = peak(PlanOptions(method="ring"), layout, shape)
            cells = []
            for budget in budgets:
                plan = build_plan(PlanOptions(memory_budget=budget), layout, True, shape)
                levels = f"{'/'.join(plan.cross)} across, {'/'.join(plan.intra)} inside"
                cells.append(f"{levels}: {plan_peak(plan, shape) / ring:.2f}x")
            print(f"| {m} x {p} | {h_kv} | {ring / 2**20:.1f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
