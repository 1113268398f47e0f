"""How much work one CPU host does with k single-threaded processes on it at once.

Each of k processes (one torch thread each) repeats the same work, all started at one barrier;
the host's capacity is ``k x time alone / time until the last ends``: the number of processes
it runs at full speed at once. The replay of a CPU profile shares the host's ``shared_slots``
equally among the ranks computing (Note [Ranks sharing a host] in
``megatron_charm/sim/engine.py``); a capacity that fell with k would be a cost of more ranks
that it does not model.

Run: ``python scripts/bench/host_capacity.py`` (about 15 s on two cores).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import time
from collections.abc import Callable

import torch

from megatron_charm.bench.report import emit


def _work(kind: str) -> Callable[[], object]:
    if kind == "block":  # one attention block, as the testbed's small sweep points run
        a = torch.randn(1, 4, 64, 64, dtype=torch.bfloat16)
        return lambda: torch.nn.functional.scaled_dot_product_attention(a, a, a)
    if kind == "ops":  # a chain of small operations: the host's own work per call
        x = torch.randn(64, 64)

        def chain() -> torch.Tensor:
            y = x
            for _ in range(20):
                y = y.add(1.0).mul_(0.5)
            return y

        return chain
    raise ValueError(f"kind={kind!r}: expected 'block' or 'ops'; pass --kinds block,ops")


def _process(kind: str, reps: int, barrier, out) -> None:
    torch.set_num_threads(1)
    fn = _work(kind)
    for _ in range(20):
        fn()
    barrier.wait()
    for _ in range(reps):
        fn()
    out.put(None)


def makespan(kind: str, k: int, reps: int) -> float:
    """Seconds from the barrier until the last of ``k`` processes has done ``reps`` calls."""
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(k + 1), ctx.Queue()
    procs = [ctx.Process(target=_process, args=(kind, reps, barrier, out)) for _ in range(k)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=60)
        start = time.perf_counter()
        for _ in range(k):
            out.get(timeout=600)
        return time.perf_counter() - start
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="block,ops")
    ap.add_argument("--processes", default="2,4,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2000, help="calls per process")
    ap.add_argument("--md", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    lines = [
        f"Host capacity, {datetime.date.today()}, {os.cpu_count()} CPUs: k x time alone / time "
        "of all k (`python scripts/bench/host_capacity.py`).",
        "",
        "| work | processes | capacity, each run | time alone (ms) |",
        "|---|---|---|---|",
    ]
    for kind in args.kinds.split(","):
        makespan(kind, 2, args.reps // 10)  # the first processes' set-up out of the timings
        alone = min(makespan(kind, 1, args.reps) for _ in range(args.runs))
        for k in (int(x) for x in args.processes.split(",")):
            caps = [k * alone / makespan(kind, k, args.reps) for _ in range(args.runs)]
            shown = ", ".join(f"{c:.2f}" for c in caps)
            lines.append(f"| {kind} | {k} | {shown} | {alone * 1e3:.0f} |")
    emit("\n".join(lines) + "\n", args.md)


if __name__ == "__main__":
    main()
