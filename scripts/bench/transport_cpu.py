#!/usr/bin/env python3
"""CPU seconds per byte of gloo's point-to-point transfers, per link rate: what the host work per
byte of a CPU profile (Note [Host work of a call] in megatron_charm/sim/profile.py) costs on
links slower or faster than the one it was calibrated on.

Each rank exchanges a message with a partner on the other node (``isend`` + ``irecv``, both
ways at once), six times per size after a barrier; the first call warms up. Per size it prints
the slowest rank's median wall time and the ranks' mean process CPU time (all threads) per byte
sent, counting the send and the receive of each rank. Needs the testbed (root, docs/testbed.md);
``--rates`` builds one testbed of two nodes per rate and per count of ``--ranks-per-node`` (on the
shared topology their transfers share the node's one cross link, each at a fraction of its rate):

    python scripts/bench/transport_cpu.py --rates 50mbit,100mbit,1gbit [--ranks-per-node 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from megatron_charm.bench.report import emit
from megatron_charm.testbed.script import add_rank_arguments, run_script_ranks

SIZES = (64 << 10, 512 << 10, 2 << 20)


def rank_main(out_path: str) -> None:
    """One rank: the timed exchanges; rank 0 writes ``[(bytes, wall_s, cpu_s_per_rank)]``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    global_rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    partner = (global_rank + world // 2) % world
    rows = []
    for nbytes in SIZES:
        send, recv = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        walls, cpus = [], []
        for rep in range(6):
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            works = [dist.isend(send, partner), dist.irecv(recv, partner)]
            for w in works:
                w.wait()
            if rep:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
        mine = (statistics.median(walls), statistics.median(cpus))
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        wall = max(w for w, _ in everyone)
        rows.append((nbytes, wall, statistics.mean(c for _, c in everyone)))
    if global_rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="50mbit,100mbit,1gbit", help="cross-link rates, tc syntax")
    ap.add_argument("--ranks-per-node", default="1", help="ranks on each of the 2 nodes, a list")
    ap.add_argument("--topology", default="shared", choices=("shared", "rails"))
    ap.add_argument("--md", help="also write the table here")
    add_rank_arguments(ap)  # a rank's: OUT
    args = ap.parse_args()
    if args.rank_out:
        rank_main(args.rank_out)
        return 0
    per_node = [int(x) for x in args.ranks_per_node.split(",")]
    if min(per_node) < 1:
        raise ValueError(f"--ranks-per-node {args.ranks_per_node}: expected at least 1 rank each")
    lines = [
        "| layout | cross rate | message | wall ms | CPU per rank ms | CPU ns per byte sent |",
        "|---|---|---|---|---|---|",
    ]
    for n, rate in ((n, rate) for n in per_node for rate in args.rates.split(",")):
        layout = f"2 x {n} {args.topology}"
        rows = run_script_ranks(__file__, [], 2, n, rate, args.topology, timeout_s=600)
        assert isinstance(rows, list)
        for nbytes, wall, cpu in rows:
            lines.append(
                f"| {layout} | {rate} | {nbytes >> 10} KiB | {wall * 1e3:.2f} | {cpu * 1e3:.2f} | "
                f"{cpu / nbytes * 1e9:.2f} |"
            )
    text = "\n".join(lines)
    emit(text, args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
