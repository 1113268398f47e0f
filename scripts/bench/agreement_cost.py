#!/usr/bin/env python3
"""What the per-call agreement of the CP ranks costs (Note [Call agreement] in
megatron_charm/comm/agreement.py): ``check_agreement`` as it runs in every ``cp_attention``
call (one all_reduce of ``[fingerprint, -fingerprint]`` over the control group), next to the
all_gather of the fingerprints it replaced.

Every rank times each one ``--iters`` times, each after a barrier of the default group, the
first two dropped; per layout the script prints the median over the calls of each rank, the
median and the largest over the ranks, in ms. Needs the testbed (root, docs/testbed.md), one per
layout (two to sixteen nodes):

    python scripts/bench/agreement_cost.py --layouts 2x2,2x4,4x2,2x8 [--md FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

from megatron_charm.bench.report import emit
from megatron_charm.testbed.script import add_rank_arguments, run_script_ranks

WAYS = ("all_reduce (check_agreement)", "all_gather (before 2026-12-06)")


def rank_main(iters: int, out_path: str) -> None:
    """One rank: the timed agreements; rank 0 writes every rank's medians (seconds)."""
    import torch
    import torch.distributed as dist

    from megatron_charm.bench.worker import start_rank
    from megatron_charm.comm.agreement import CallKey, check_agreement, hash_layout
    from megatron_charm.plan import PlanOptions
    from megatron_charm.testbed.script import gather_to_file

    _, topo = start_rank({"threads": 1})
    key = CallKey((512, 1, 4, 64), 4, "torch.bfloat16", True, 0.125, PlanOptions())

    def gathered() -> None:
        mine = torch.tensor([key.fingerprint() ^ hash_layout(topo)], dtype=torch.int64)
        got = [torch.empty_like(mine) for _ in range(topo.cp_size)]
        dist.all_gather(got, mine, group=topo.control)
        assert len({int(t) for t in got}) == 1, "the ranks' keys differ"

    mine = []
    for way in (lambda: check_agreement(topo, key), gathered):
        times = []
        for _ in range(iters + 2):
            dist.barrier()
            t0 = time.perf_counter()
            way()
            times.append(time.perf_counter() - t0)
        mine.append(statistics.median(times[2:]))
    gather_to_file(mine, out_path)


def run_layout(layout: str, iters: int, cross_rate: str) -> list[list[float]]:
    """Every rank's medians ``[all_reduce, all_gather]`` on a fresh testbed of ``layout``."""
    nodes, per_node = (int(x) for x in layout.split("x"))
    ranks = run_script_ranks(__file__, [str(iters)], nodes, per_node, cross_rate)
    assert isinstance(ranks, list)
    return ranks


def markdown(rows: list[tuple[str, list[list[float]]]], iters: int, cross_rate: str) -> str:
    lines = [
        f"Per-call agreement of the CP ranks, {datetime.date.today()}: ms per call, the median "
        f"of {iters} calls per rank after a barrier each; over the ranks, median / largest "
        f"(testbed, cross links {cross_rate}, shared topology).",
        "",
        "| layout | ranks | " + " | ".join(WAYS) + " |",
        "|---|---|" + "---|" * len(WAYS),
    ]
    for layout, ranks in rows:
        cells = []
        for i in range(len(WAYS)):
            vals = [r[i] * 1e3 for r in ranks]
            cells.append(f"{statistics.median(vals):.2f} / {max(vals):.2f}")
        lines.append(f"| {layout} | {len(ranks)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--layouts", default="2x2,2x4,4x2,2x8", help="NODESxRANKS_PER_NODE, comma-separated"
    )
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cross-rate", default="200mbit")
    ap.add_argument("--md", help="also write the table here")
    add_rank_arguments(ap)  # a rank's: OUT, then ITERS
    args = ap.parse_args(argv)
    if args.rank_out:
        rank_main(int(args.rank_args[0]), args.rank_out)
        return 0
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    for layout in layouts:
        parts = layout.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(
                f"--layouts entry {layout!r} must be NODESxRANKS_PER_NODE with positive integers "
                "(e.g. 2x4)"
            )
        if not 2 <= int(parts[0]) <= 16:
            raise ValueError(
                f"--layouts entry {layout!r}: the testbed emulates 2 to 16 nodes; "
                "give NODES in [2, 16]"
            )
    if args.iters < 1:
        raise ValueError(f"--iters {args.iters} must be >= 1")
    rows = [(layout, run_layout(layout, args.iters, args.cross_rate)) for layout in layouts]
    emit(markdown(rows, args.iters, args.cross_rate), args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
