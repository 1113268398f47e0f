"""Host time the runner spends deriving a program's steps and release points at every call,
against the cached lookup that replaced it (Note [Derived once] in megatron_charm/comm/derived.py).

For rank 0 of each layout, causal, default options: the plain derivation (steps, release
points, head-expansion drops, kept query pieces) and ``pass_steps`` / ``kept_by`` once cached,
microseconds per call, forward and backward.

Run: ``python scripts/bench/derive_cost.py --md docs/results/executor/derived-once.table.md``
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import timeit

from megatron_charm import plan as planner
from megatron_charm.bench.report import emit
from megatron_charm.comm import derived
from megatron_charm.plan import Layout, PlanOptions
from megatron_charm.plan.coalesce import steps
from megatron_charm.plan.keep import kept_pieces
from megatron_charm.plan.memory import expansion_drops, own_keys, release_points


def _us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def measure(method: str, m: int, p: int, number: int) -> list[str]:
    options, layout = PlanOptions(method=method), Layout(m, p)
    cross, intra = planner.plan_levels(options, layout, True)
    fwd, bwd = planner.rank_plan(options, layout, True, cross, 0, intra)
    rows = []
    for prog, backward in ((fwd, False), (bwd, True)):
        own = frozenset(own_keys(0, backward))

        def plain(prog=prog, own=own, backward=backward) -> None:
            list(steps(prog.instrs, True))
            release_points(prog, set(own), backward)
            expansion_drops(prog)
            if backward:
                kept_pieces(prog)

        def cached(prog=prog, own=own, backward=backward) -> None:
            derived.pass_steps(prog, own, backward, True, True)
            if backward:
                derived.kept_by(prog)

        cached()
        rows.append(
            f"| {method} | {m} x {p} | {'backward' if backward else 'forward'} | "
            f"{len(prog.instrs)} | {_us(plain, number):.0f} | {_us(cached, number):.1f} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="2x2,2x8,4x8", help="NODESxRANKS_PER_NODE, ...")
    ap.add_argument("--methods", default="charm,ring")
    ap.add_argument("--number", type=int, default=200, help="calls per timing")
    ap.add_argument("--md", default=None, help="write the table to this markdown file")
    args = ap.parse_args()
    lines = [
        f"### Deriving a program at every call, {datetime.date.today()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "",
        "Command: `python scripts/bench/derive_cost.py --layouts "
        f"{args.layouts} --methods {args.methods}` (rank 0, causal, default options; "
        "microseconds per call, the best of 5 repeats).",
        "",
        "| method | layout | pass | instructions | derived at every call (us) | cached (us) |",
        "|---|---|---|---|---|---|",
    ]
    for method in args.methods.split(","):
        for spec in args.layouts.split(","):
            m, p = (int(x) for x in spec.split("x"))
            lines += measure(method, m, p, args.number)
    emit("\n".join(lines), args.md)


if __name__ == "__main__":
    main()
