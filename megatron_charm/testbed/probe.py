"""Bandwidth probe: timed gloo send/recv between ranks of a built testbed.

The driver (:func:`probe`, :func:`measure_intra`) launches this module as the ranks; each rank
joins one gloo group and the senders of each *phase* (a set of disjoint pairs run at the same
time) time ``send(nbytes)`` + a one-element acknowledgement. gloo is what the benchmarks use, so
the numbers include its copies, not just the raw socket speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_charm.testbed.testbed import Testbed

_TAG = "MCTB_PROBE "
#: Seconds for every distributed call of the probe; a stuck link fails fast instead of hanging.
CALL_TIMEOUT_S = 60.0


@dataclass
class Phase:
    """Pairs ``(sender, receiver)`` (ranks of the probe job) that transfer at the same time."""

    name: str
    pairs: list[tuple[int, int]]
    nbytes: int


def probe(
    tb: Testbed,
    *,
    cross_bytes: int | None = None,
    intra_bytes: int = 64 << 20,
    repeats: int = 3,
    timeout_s: float = 300.0,
) -> dict:
    """Measure intra-node and cross-node bandwidth on ``tb`` with every rank slot.

    Phases: ``intra`` (rank 0 -> 1 on node 0, when a node has two ranks), ``cross`` (local 0 of
    node 0 -> local 0 of node 1), and ``cross_all`` (every local index of node 0 -> the same index
    of node 1 at once: one link shared by all in ``shared``, one rail each in ``rails``).
    """
    cfg = tb.config
    p = cfg.ranks_per_node
    rate = tb.cross_rate_bps or 0
    if cross_bytes is None:
        # About half a second per transfer at the configured rate.
        cross_bytes = int(min(max(rate / 8 * 0.5, 256 << 10), 256 << 20))
    phases = []
    if p > 1:
        phases.append(Phase("intra", [(0, 1)], intra_bytes))
    phases.append(Phase("cross", [(0, p)], cross_bytes))
    if p > 1:
        phases.append(Phase("cross_all", [(i, p + i) for i in range(p)], cross_bytes))
    results = _run_phases(tb, phases, None, repeats, timeout_s)
    for res in results:
        if res["name"].startswith("cross"):
            per_link = res["aggregate_bps"]
            if cfg.topology == "rails":
                per_link /= len(res["pairs"])
            res["configured_link_bps"] = rate
            res["per_link_bps"] = per_link
            res["per_link_vs_configured"] = per_link / rate if rate else None
    return {"testbed": tb.describe(), "repeats": repeats, "phases": results}


def measure_intra(tb: Testbed, nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Intra-node bandwidth (bits/s) between two ranks of node 0, before cross shaping."""
    second = (0, 1) if tb.config.ranks_per_node > 1 else (0, 0)
    res = _run_phases(tb, [Phase("intra", [(0, 1)], nbytes)], [(0, 0), second], repeats, 300.0)
    return res[0]["aggregate_bps"]


def _run_phases(
    tb: Testbed,
    phases: list[Phase],
    placements: list[tuple[int, int]] | None,
    repeats: int,
    timeout_s: float,
) -> list[dict]:
    spec = json.dumps([[ph.name, ph.pairs, ph.nbytes] for ph in phases])
    # Run this file as a script (-P: without its folder on sys.path), so the ranks need neither
    # the package on their path nor its import cost.
    cmd = [
        sys.executable,
        "-P",
        os.path.abspath(__file__),
        "--phases",
        spec,
        "--repeats",
        str(repeats),
    ]
    run = tb.run(cmd, timeout_s=timeout_s, capture=True, placements=placements).check()
    times: dict[tuple[str, int], list[float]] = {}
    for res in run.ranks:
        for line in (res.stdout or "").splitlines():
            if line.startswith(_TAG):
                rec = json.loads(line[len(_TAG) :])
                times[(rec["phase"], rec["sender"])] = rec["seconds"]
    out = []
    for ph in phases:
        per_pair = [times[(ph.name, s)] for s, _ in ph.pairs]
        # A phase lasts as long as its slowest pair, repetition by repetition.
        spans = [max(rep) for rep in zip(*per_pair, strict=True)]
        span = statistics.median(spans)
        out.append(
            {
                "name": ph.name,
                "pairs": ph.pairs,
                "bytes_per_pair": ph.nbytes,
                "seconds_median": span,
                "seconds_all": spans,
                "aggregate_bps": 8 * ph.nbytes * len(ph.pairs) / span,
            }
        )
    return out


def _worker(phases: list[tuple[str, list[list[int]], int]], repeats: int) -> None:
    """One rank of the probe job (env from the launcher)."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=CALL_TIMEOUT_S)
    dist.init_process_group("gloo", timeout=timeout)
    me = dist.get_rank()
    try:
        for name, pairs, nbytes in phases:
            role = next(((s, r) for s, r in pairs if me in (s, r)), None)
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            ack = torch.zeros(1, dtype=torch.uint8)
            seconds = []
            for rep in range(repeats + 1):  # the first one warms up TCP and the token bucket
                dist.barrier()
                if role is None:
                    continue
                sender, receiver = role
                if me == sender:
                    t0 = time.perf_counter()
                    dist.isend(buf, receiver).wait(timeout)
                    dist.irecv(ack, receiver).wait(timeout)
                    if rep:
                        seconds.append(time.perf_counter() - t0)
                else:
                    dist.irecv(buf, sender).wait(timeout)
                    dist.isend(ack, sender).wait(timeout)
            if role is not None and me == role[0]:
                rec = {"phase": name, "sender": me, "seconds": seconds, "pid": os.getpid()}
                print(_TAG + json.dumps(rec), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--phases", required=True, help="JSON [[name, [[src, dst], ...], bytes]]")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    _worker(json.loads(args.phases), args.repeats)


if __name__ == "__main__":
    main()
