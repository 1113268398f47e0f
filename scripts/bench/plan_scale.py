"""Planning time against CP size: a rank's first call, and the simulator's exact replay.

Measures, causal, 8 ranks per node, default plan options per method:
- the whole plan (``build_plan``) and its full replay (``validate``), which every rank runs up to
  ``FULL_CHECK_MAX_CP`` ranks;
- one rank's plan and check (``checked_programs`` above ``FULL_CHECK_MAX_CP``: ``rank_plan`` and
  ``check_rank_program``), on the first, a middle and the last rank (the slowest is reported);
- with ``--sim``, the simulator's exact replay (``--mode full``) of every rank.

Run: ``python scripts/bench/plan_scale.py --md docs/results/plan-scale.md`` (about 5 minutes on
two cores with ``--sim``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import time

import megatron_charm.function as fn
from megatron_charm import plan as planner
from megatron_charm.plan import Layout, PlanOptions, build_plan
from megatron_charm.plan.validate import validate
from megatron_charm.sim.predict import Problem, predict
from megatron_charm.sim.topology import PRESETS

P = 8
_CACHED_MODULES = [
    module
    for name, module in sorted(sys.modules.items())
    if name == "megatron_charm.function" or name.startswith("megatron_charm.plan")
]


def _clear() -> None:
    """Forget every cached planning result, so that each measurement pays a rank's first call.
    Every ``lru_cache`` of the planner's modules and of ``megatron_charm.function``: the auto
    choices (``_auto_levels``, ``_auto_intra``, ``_auto_keep``, ...) replay a small layout that
    does not depend on the CP size, and one left cached made every size measured after the
    first cheaper (until 2026-12-07 21:20 UTC)."""
    for module in _CACHED_MODULES:
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def whole(method: str, cp: int) -> tuple[float, float]:
    _clear()
    gc.collect()
    layout = Layout(cp // P, P)
    start = time.perf_counter()
    plan = build_plan(PlanOptions(method=method), layout, True)
    built = time.perf_counter()
    validate(plan)
    return built - start, time.perf_counter() - built


def one_rank(method: str, cp: int) -> float:
    layout, worst = Layout(cp // P, P), 0.0
    for x in (0, cp // 2 + 3, cp - 1):
        _clear()
        gc.collect()  # the garbage of a previous measurement is not this one's cost
        start = time.perf_counter()
        options = PlanOptions(method=method)
        cross, intra = planner.plan_levels(options, layout, True)
        fn._checked_rank(options, layout, True, cross, x, intra)
        worst = max(worst, time.perf_counter() - start)
    return worst


def sim_full(method: str, cp: int) -> float:
    """Seconds of the simulator's exact replay (every rank built and replayed) on H100 links."""
    _clear()
    gc.collect()
    hw = PRESETS["H100"]
    topo = hw.topology(cp // P, P)
    compute = hw.compute_model()
    problem = Problem(1, 2048 * cp, 32, 128, causal=True)
    start = time.perf_counter()
    predict(topo, problem, compute, (method,), mode="full")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="charm,rm+,ring")
    ap.add_argument("--whole", default="16,32,64,128", help="CP sizes for the whole plan")
    ap.add_argument("--one", default="128,256,1024", help="CP sizes for one rank's plan")
    ap.add_argument("--sim", default="", help="CP sizes for the simulator's exact replay")
    ap.add_argument("--md", default=None, help="append the tables to this markdown file")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    one_rank(methods[0], 16)  # imports and first-call set-up out of the timings
    lines = [
        f"### Planning time, {datetime.date.today()}, {platform.processor() or platform.machine()}"
        f", {os.cpu_count()} CPUs",
        "",
        "Command: `python scripts/bench/plan_scale.py "
        + " ".join(
            f"{k} {v or chr(34) * 2}"
            for k, v in zip(argv[::2], argv[1::2], strict=False)
            if k != "--md"
        )
        + "` (causal, 8 ranks per node, default options; seconds of one process).",
    ]
    if args.whole:
        lines += [
            "",
            "| method | CP | whole plan: build | whole plan: full replay | total |",
            "|---|---|---|---|---|",
        ]
    for method in methods:
        for cp in (int(c) for c in args.whole.split(",") if c):
            b, v = whole(method, cp)
            lines.append(f"| {method} | {cp} | {b:.2f} | {v:.2f} | {b + v:.2f} |")
            print(lines[-1], flush=True)
    if args.one:
        lines += [
            "",
            "| method | CP | one rank: plan + check (slowest of 3 ranks) |",
            "|---|---|---|",
        ]
    for method in methods:
        for cp in (int(c) for c in args.one.split(",") if c):
            lines.append(f"| {method} | {cp} | {one_rank(method, cp):.3f} |")
            print(lines[-1], flush=True)
    if args.sim:
        lines += ["", "| method | CP | simulator, exact replay of every rank |", "|---|---|---|"]
        for method in methods:
            for cp in (int(c) for c in args.sim.split(",") if c):
                lines.append(f"| {method} | {cp} | {sim_full(method, cp):.1f} |")
                print(lines[-1], flush=True)
    if args.md:
        with open(args.md, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
