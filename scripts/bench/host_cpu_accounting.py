#!/usr/bin/env python3
"""CPU seconds a testbed sweep's passes used against what the replay charges the shared host.

On the CPU testbed every rank runs on one host, so a pass can take no less wall time than the
CPU its ranks use over the host's cores. Every timed call of ``megatron-charm-bench attention``
records each rank's process CPU seconds (all its threads); the results hold their sum over the
ranks (``cpu_s``, the median over the iterations). The replay of a CPU profile charges the host
the seconds alone of its blocks, merges, host work and the transport's threads
(``PassResult.host_work``; Note [Host work of a call] in megatron_charm/sim/profile.py). Where
the host is busy most of a pass, the pass takes about its CPU seconds over the cores, and CPU
that the replay does not charge makes the measured pass slower than the replayed one.

Per layout: how busy the host was (measured CPU over cores x wall, median), the replay's work
over the measured CPU (median), the CPU the replay does not charge per rank and second of the
pass (a least squares fit of ``cpu - work = u x ranks x wall``), and the median time error of
the rows where the host was busy (at least 80%) and of the others; then every row.

    python scripts/bench/host_cpu_accounting.py PROFILE.json docs/results/SWEEP/*.json \\
        [--profile-rate 100mbit] [--md FILE]

(a few seconds)
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from collections import defaultdict

from megatron_charm.bench.report import emit
from megatron_charm.sim import testbed
from megatron_charm.sim.profile import load_profile

#: Hosts at least this busy over a pass count as busy.
BUSY = 0.8


def rows_of(
    paths: list[str], profile: str, profile_rate: str | None, cores: float | None = None
) -> list[dict]:
    """``testbed.compare``'s rows of every point in ``paths`` (runs of one point grouped), each
    with its ``point``, ``layout`` ("2x4"), ``ranks`` and the host's ``cores`` (``cores``, else
    the profile's ``shared_slots``); rows whose result has no ``cpu_s`` are left out."""
    base = load_profile(profile)
    cores = cores or float(base.compute.get("shared_slots") or 0.0)
    if cores <= 0:
        raise ValueError(
            f"profile {profile!r} has no shared host (shared_slots 0): this accounting is of a "
            "CPU profile's host; pass one that `calibrate` wrote on the CPU testbed, or --cores"
        )
    out = []
    for name, runs in testbed.group_runs(paths):
        result = runs[0][1]
        prof = testbed.profile_for(base, result, profile_rate)
        cal = testbed.calibrate(result, None, profile=prof)
        nodes, per_node = result["layout"]
        for row in testbed.compare(result, cal=cal, repeats=[r for _, r in runs[1:]]):
            if row.get("cpu_s") is None:
                continue
            out.append(
                dict(
                    row,
                    point=name.removesuffix(".json"),
                    layout=f"{nodes}x{per_node}",
                    ranks=nodes * per_node,
                    cores=cores,
                )
            )
    return out


def unexplained_per_rank_second(rows: list[dict]) -> float:
    """Least squares ``u`` of ``cpu_s - host_work_s = u x ranks x measured_s`` over ``rows``:
    the CPU the replay does not charge, in cores per rank."""
    xs = [r["ranks"] * r["measured_s"] for r in rows]
    ys = [r["cpu_s"] - r["host_work_s"] for r in rows]
    den = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys, strict=True)) / den if den > 0 else 0.0


def summary(rows: list[dict]) -> list[dict]:
    """One line per layout, in the order first seen (see the module's docstring)."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["layout"]].append(r)
    lines = []
    for layout, group in by.items():
        busy = [r["cpu_s"] / (r["cores"] * r["measured_s"]) for r in group]
        hot = [r["error"] for r, b in zip(group, busy, strict=True) if b >= BUSY]
        cold = [r["error"] for r, b in zip(group, busy, strict=True) if b < BUSY]
        lines.append(
            {
                "layout": layout,
                "rows": len(group),
                "busy": statistics.median(busy),
                "charged": statistics.median(r["host_work_s"] / r["cpu_s"] for r in group),
                "unexplained": unexplained_per_rank_second(group),
                "busy_rows": len(hot),
                "busy_error": statistics.median(hot) if hot else None,
                "other_error": statistics.median(cold) if cold else None,
            }
        )
    return lines


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def markdown(rows: list[dict], command: str) -> str:
    """The per-layout table of :func:`summary`, then one line per row."""
    out = [
        f"CPU accounting, {datetime.date.today()} (`{command}`): busy = measured CPU / (cores x "
        "wall), median; charged = the replay's host work / measured CPU, median; unexplained = "
        "cores per rank the replay does not charge (least squares over the rows); time errors "
        f"(predicted / measured - 1, median) where the host was busy >= {BUSY:.0%} and where not.",
        "",
        "| layout | rows | busy | charged | unexplained, cores per rank | busy rows | "
        "their error | other rows' error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary(rows):
        out.append(
            f"| {s['layout']} | {s['rows']} | {s['busy']:.2f} | {s['charged']:.2f} | "
            f"{s['unexplained']:.3f} | {s['busy_rows']} | {_pct(s['busy_error'])} | "
            f"{_pct(s['other_error'])} |"
        )
    out += [
        "",
        "| point | method | pass | CPU used ms | charged ms | charged / used | "
        "used / (cores x wall) | time error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        used, want = r["cpu_s"], r["host_work_s"]
        out.append(
            f"| {r['point']} | {r['method']} | {r['pass']} | {used * 1e3:.1f} | "
            f"{want * 1e3:.1f} | {want / used:.2f} | "
            f"{used / (r['cores'] * r['measured_s']):.2f} | {_pct(r['error'])} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="a calibrate profile of the CPU testbed")
    ap.add_argument("results", nargs="+", help="benchmark result JSON files")
    ap.add_argument("--profile-rate", default="100mbit", help="the rate it was calibrated at")
    ap.add_argument("--cores", type=float, help="cores of the host (default: the profile's)")
    ap.add_argument("--md", help="also write the tables here")
    args = ap.parse_args(argv)
    rows = rows_of(args.results, args.profile, args.profile_rate, args.cores)
    if not rows:
        raise ValueError("no result has cpu_s: run the benchmark with this version or later")
    command = (
        f"python scripts/bench/host_cpu_accounting.py PROFILE RESULTS "
        f"--profile-rate {args.profile_rate}"
    )
    emit(markdown(rows, command), args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
