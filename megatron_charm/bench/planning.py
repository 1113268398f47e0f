"""``megatron-charm-bench planning``: what a new document mask costs to plan, at any CP size.

A data loader whose documents change every step hands the planner a new mask each step; plans
are cached by the pattern of non-empty blocks (Note [Pruning to a mask]), so the cost that
matters is one new pattern: resolve it, prune the cached dense plan to it, validate the result.
Pure planning: no torch, no ranks.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from megatron_charm.plan import Layout, PlanOptions, plan_levels, plan_with_levels
from megatron_charm.plan.docmask import DocMask
from megatron_charm.plan.options import METHODS
from megatron_charm.plan.validate import validate


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--method", default="charm", choices=[m for m in METHODS if m != "ring-contig"])
    ap.add_argument("--seq", type=int, default=131072, help="global tokens")
    ap.add_argument("--docs", type=int, default=64, help="documents per sample (random cuts)")
    ap.add_argument("--layout", choices=("bshd", "thd"), default="bshd")
    ap.add_argument("--masks", type=int, default=3, help="new random masks to plan")
    ap.add_argument("--seed", type=int, default=0)


def random_mask(rng: random.Random, seq: int, docs: int, cp_size: int, layout: str) -> DocMask:
    """``docs`` documents over ``seq`` tokens (``thd``: lengths rounded to ``2 * cp_size``)."""
    unit = 2 * cp_size if layout == "thd" else 1
    slots = seq // unit
    cuts = sorted(rng.sample(range(1, slots), min(docs - 1, slots - 1)))
    lens = [(b - a) * unit for a, b in zip([0, *cuts], [*cuts, slots], strict=True)]
    return DocMask(tuple(lens), layout)


def run_planning(args: argparse.Namespace) -> dict:
    """Time the dense plan once, then ``--masks`` new patterns; print and return seconds."""
    layout = Layout(args.nodes, args.ranks_per_node)
    n = layout.cp_size
    if args.seq % (2 * n) or args.docs < 1:
        raise ValueError(
            f"--seq {args.seq} must be a multiple of 2 x CP size ({2 * n}) and --docs >= 1"
        )
    opts = PlanOptions(method=args.method)
    t0 = time.perf_counter()
    cross, intra = plan_levels(opts, layout, True)
    plan_with_levels(opts, layout, True, cross, intra=intra)
    dense = time.perf_counter() - t0
    rng = random.Random(args.seed)
    rows = []
    seen: set[frozenset] = set()  # cp_attention validates a plan once per pattern, as here
    for _ in range(args.masks):
        mask = random_mask(rng, args.seq, args.docs, n, args.layout)
        t0 = time.perf_counter()
        model = mask.model(n, True)
        pattern = model.pattern
        t1 = time.perf_counter()
        plan = plan_with_levels(opts, layout, model.dense_causal, cross, pattern, intra)
        t2 = time.perf_counter()
        if pattern not in seen:
            validate(plan)
            seen.add(pattern)
        t3 = time.perf_counter()
        rows.append((len(pattern), t1 - t0, t2 - t1, t3 - t2))
    total = [p + q + r for _, p, q, r in rows]
    result = {
        "layout": [args.nodes, args.ranks_per_node],
        "method": args.method,
        "dense_plan_s": dense,
        "masks": [
            dict(zip(("blocks", "pattern_s", "prune_s", "validate_s"), r, strict=True))
            for r in rows
        ],
        "new_pattern_s_median": statistics.median(total),
    }
    print(
        f"{args.method} on {args.nodes} x {args.ranks_per_node}, {args.docs} {args.layout} "
        f"documents in {args.seq} tokens: dense plan {dense:.2f} s (once); per new pattern:"
    )
    for blocks, p, q, r in rows:
        print(
            f"  {blocks} of {(2 * n) ** 2} half blocks non-empty: pattern {p:.2f} s, prune "
            f"{q:.2f} s, validate {r:.2f} s"
        )
    return result
