#!/usr/bin/env python3
"""Two ranks swap one tensor each way over gloo and time it (Note [Receives first]).

Run as two ranks on two testbed nodes, e.g.::

    python -m megatron_charm.testbed run --nodes 2 --ranks-per-node 1 --cross-rate 50mbit -- \\
        python scripts/bench/gloo_swap.py --mib 1 --tries 8

For each order of posting (sends first, receives first) and each delay of rank 1 (a rank still
computing when its peer's message arrives), rank 0 prints per try when each rank's swap (its
send and its receive) completed, in ms from a barrier (rank 0 / rank 1), beside the one-way
time at the configured rate.

``--run`` times a run of exchanges instead, on any number of ranks (Note [Receives of a run
first] in megatron_charm/comm/executor.py): every rank posts one exchange per offset ``o``
(send to ``rank + o``, receive from ``rank - o``), as all_gather's forward does, in each of
``RUN_ORDERS``. Rank 0 prints the slowest rank's time per try::

    python -m megatron_charm.testbed run --nodes 2 --ranks-per-node 4 --topology rails \
        --cross-rate 100mbit -- python scripts/bench/gloo_swap.py --run --mib 0.5 --tries 8
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from megatron_charm.comm.executor import run_batches


def swap(peer: int, out: torch.Tensor, into: torch.Tensor, receives_first: bool) -> None:
    if receives_first:
        works = [dist.irecv(into, peer), dist.isend(out, peer)]
    else:
        works = [dist.isend(out, peer), dist.irecv(into, peer)]
    for work in works:
        work.wait()


#: How ``--run`` posts a run: exchange by exchange (each with its receive first, the executor
#: before 2026-12-05 18:05 UTC), or as the executor does on gloo now (``run_batches``: every
#: receive of the run, then every send).
RUN_ORDERS = ("exchange by exchange", "every receive of the run first")


def post_run(out: torch.Tensor, into: list[torch.Tensor], order: str) -> None:
    """One exchange per offset ``o``: send to ``rank + o``, receive from ``rank - o``."""
    rank, size = dist.get_rank(), dist.get_world_size()
    recvs = [dist.P2POp(dist.irecv, into[o - 1], (rank - o) % size) for o in range(1, size)]
    sends = [dist.P2POp(dist.isend, out, (rank + o) % size) for o in range(1, size)]
    if order == RUN_ORDERS[1]:
        staged = [(o, [r], [s]) for o, (r, s) in enumerate(zip(recvs, sends, strict=True))]
        batches = [ops for _, ops in run_batches(staged)]
    else:
        batches = [[r, s] for r, s in zip(recvs, sends, strict=True)]
    works = [w for batch in batches for w in dist.batch_isend_irecv(batch)]
    for work in works:
        work.wait()


def time_runs(n: int, tries: int) -> None:
    size = dist.get_world_size()
    out, into = torch.ones(n), [torch.empty(n) for _ in range(size - 1)]
    for order in RUN_ORDERS:
        times = []
        for _ in range(tries):
            dist.barrier()
            t0 = time.perf_counter()
            post_run(out, into, order)
            slowest = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times.append(slowest.item() * 1e3)
        if dist.get_rank() == 0:
            ms = sorted(times)
            print(
                f"{order}: median {ms[len(ms) // 2]:.0f} ms, tries "
                + " ".join(f"{t:.0f}" for t in times)
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=1.0, help="MiB sent each way")
    ap.add_argument("--tries", type=int, default=8)
    ap.add_argument("--late-ms", default="0,50", help="comma list: rank 1's delay before posting")
    ap.add_argument("--run", action="store_true", help="time a run of exchanges (see above)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    cp_rank, size = dist.get_rank(), dist.get_world_size()
    if args.run:
        time_runs(int(args.mib * (1 << 20)) // 4, args.tries)
        dist.destroy_process_group()
        return
    if size != 2:
        raise ValueError(f"gloo_swap runs on 2 ranks, got {size}; launch with --nodes 2")
    peer = 1 - cp_rank
    n = int(args.mib * (1 << 20)) // 4
    out, into = torch.ones(n), torch.empty(n)
    rate = os.environ.get("MEGATRON_CHARM_TESTBED_CROSS_BPS")
    one_way = f"{n * 4 / (float(rate) / 8) * 1e3:.0f} ms" if rate else "unknown"
    for receives_first in (False, True):
        for late_ms in (float(x) for x in args.late_ms.split(",")):
            done = []
            for _ in range(args.tries):
                dist.barrier()
                t0 = time.perf_counter()
                if cp_rank == 1:
                    time.sleep(late_ms / 1e3)
                swap(peer, out, into, receives_first)
                mine = (time.perf_counter() - t0) * 1e3
                both = [0.0, 0.0]
                dist.all_gather_object(both, mine)
                done.append(both)
            if cp_rank == 0:
                order = "receives first" if receives_first else "sends first"
                tries = " ".join(f"{a:.0f}/{b:.0f}" for a, b in done)
                print(f"{order}, rank 1 late {late_ms:.0f} ms: {tries} (one way {one_way})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
