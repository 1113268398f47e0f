#!/usr/bin/env python3
"""CPU seconds a testbed sweep's passes used against what the replay charges the shared host.

On the CPU testbed every rank runs on one host, so a pass can take no less wall time than the
CPU its ranks use over the host's cores. The sweep records each method's process CPU time
summed over the ranks (``cpu_s``, median over the iterations); the replay charges the host the
"seconds alone" of its blocks and merges plus the profile's host work (Note [Host work of a
call] in megatron_charm/sim/profile.py). Per sweep point, method and pass this prints both,
and the measured wall time over the host's capacity (``cores x wall``):

    python scripts/bench/host_cpu_accounting.py PROFILE.json docs/results/SWEEP/*.json \\
        [--profile-rate 100mbit] [--md FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

from megatron_charm.bench.report import emit
from megatron_charm.plan.types import Exchange, Layout, Wait
from megatron_charm.sim import testbed
from megatron_charm.sim.engine import Engine
from megatron_charm.sim.profile import load_profile
from megatron_charm.sim.programs import programs


def charged(result: dict, cal: testbed.Calibration, method: str, backward: bool) -> float:
    """Seconds alone the replay charges the host for one pass, summed over the ranks."""
    m, p = result["layout"]
    shape = cal.problem.shape(m * p)
    opts = testbed._plan_options(result).replace(method=method)
    progs = programs(opts, Layout(m, p), cal.problem.causal, "auto", shape)
    eng = Engine(progs, cal.topo, shape, cal.compute, backward)
    total = eng.host_call * len(eng.instrs)
    for instrs, costs in zip(eng.instrs, eng.costs, strict=True):
        for ins, cost in zip(instrs, costs, strict=True):
            if isinstance(ins, Exchange):
                sent = sum(t.nbytes for t in cost if t.send)
                total += eng.host_post + eng.host_byte * sent
                total += eng.transport_post + eng.transport_byte * sent
            elif not isinstance(ins, Wait):
                total += cost
    return total * (m * p) / len(eng.instrs)  # a symmetric replay stands for every node


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("results", nargs="+")
    ap.add_argument("--profile-rate", default="100mbit")
    ap.add_argument("--cores", type=int, default=2, help="cores of the host the sweep ran on")
    ap.add_argument("--md")
    args = ap.parse_args()
    base = load_profile(args.profile)
    lines = [
        "| point | method | pass | CPU used ms | charged ms | charged / used | "
        "used / (cores x wall) |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios: dict[str, list[float]] = {}
    for path in args.results:
        with open(path) as fh:
            result = json.load(fh)
        prof = testbed.profile_for(base, result, args.profile_rate)
        cal = testbed.calibrate(result, None, profile=prof)
        name = path.rsplit("/", 1)[-1].removesuffix(".json")
        for method in testbed.METHODS:
            if method not in result["methods"]:
                continue
            fwd, bwd = charged(result, cal, method, False), charged(result, cal, method, True)
            for tag, want in (("fwd", fwd), ("fwdbwd", fwd + bwd)):
                got = result["methods"][method][tag]
                used, wall = got["cpu_s"], got["median"]
                ratios.setdefault(f"{result['layout'][0] * result['layout'][1]} ranks", []).append(
                    want / used
                )
                lines.append(
                    f"| {name} | {method} | {tag} | {used * 1e3:.1f} | {want * 1e3:.1f} | "
                    f"{want / used:.2f} | {used / (args.cores * wall):.2f} |"
                )
    summary = [
        f"charged / used, median: {k} {statistics.median(v):.2f} (of {len(v)})"
        for k, v in sorted(ratios.items())
    ]
    text = "\n".join([*summary, "", *lines])
    emit(text, args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
