"""How the runs of ``calibrate --repeat`` predict a testbed sweep: each run fitted alone, the
median run, and the runs pooled (Note [Repeated calibrations] in megatron_charm/sim/repeats.py).

    python scripts/bench/repeat_fits.py --raw RAW.json [--raw RAW2.json] \\
        --profile-rate 100mbit [--ranks slowest] SWEEP/*.json [--md OUT.md]

``RAW.json``: what ``calibrate --repeat N --raw RAW.json`` kept. Every fit predicts every result
(nothing taken from the results), as ``python -m megatron_charm.sim.testbed --profile`` does;
one row per fit: the times within +-20%, the median error per layout and the largest.
``--ranks slowest`` fits every block timing as the slowest rank's instead of the ranks' median
(how calibrate took it on one host before 2026-12-06), from the ranks' own timings that raw
files since then keep (``fwd_ranks_s``, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics

from megatron_charm.bench.report import emit
from megatron_charm.sim.calibrate import combine_runs
from megatron_charm.sim.repeats import split_runs
from megatron_charm.sim.testbed import calibrate, compare, group_runs, profile_for


def slowest_rank(raw: dict) -> dict:
    """``raw`` (every run) with each block timing the slowest of its ranks' own."""
    out = dict(raw)
    out["kernel"] = [
        {
            **k,
            **{
                key[: -len("_ranks_s")] + "_s": max(v)
                for key, v in k.items()
                if key.endswith("_ranks_s")
            },
        }
        for k in raw["kernel"]
    ]
    if "repeats" in raw:
        out["repeats"] = [slowest_rank(r) for r in raw["repeats"]]
    return out


def variants(raw: dict) -> list[tuple[str, dict, str]]:
    """``(label, raw samples, combine)`` for each run alone, then the median run and the pool."""
    runs = split_runs(raw)
    out = [(f"run {i + 1}", run, "pool") for i, run in enumerate(runs)]
    if len(runs) > 1:
        out += [("median run", raw, "median-run"), ("pooled", raw, "pool")]
    return out


def score(profile, groups, profile_rate: str) -> dict:
    """Every result of ``groups`` predicted by ``profile``: counts and median errors."""
    errors: dict[str, list[float]] = {}
    for _, runs in groups:
        result = runs[0][1]
        cal = calibrate(result, profile=profile_for(profile, result, profile_rate))
        rows = compare(result, cal=cal, repeats=[r for _, r in runs[1:]])
        layout = "x".join(str(x) for x in result["layout"])
        errors.setdefault(layout, []).extend(r["error"] for r in rows)
    every = [e for errs in errors.values() for e in errs]
    return {
        "within": sum(abs(e) <= 0.20 for e in every),
        "times": len(every),
        "median": statistics.median(every),
        "layouts": {k: statistics.median(v) for k, v in sorted(errors.items())},
        "largest": max(every, key=abs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="benchmark result JSONs (a sweep)")
    ap.add_argument("--raw", action="append", required=True, help="a calibrate --raw file")
    ap.add_argument("--profile-rate", required=True, help="the tc rate calibrated at (100mbit)")
    ap.add_argument("--fabric", default="nvlink")
    ap.add_argument(
        "--ranks",
        choices=("median", "slowest"),
        default="median",
        help="which of the ranks' block timings to fit (raw files that keep them)",
    )
    ap.add_argument("--md", default=None, help="also write the table here")
    args = ap.parse_args()
    groups = group_runs(args.results)
    lines = [
        "| calibration | fit | within +-20% | median error | per layout | largest |",
        "|---|---|---|---|---|---|",
    ]
    suffix = ", slowest rank" if args.ranks == "slowest" else ""
    for path in args.raw:
        with open(path) as f:
            raw = json.load(f)
        if args.ranks == "slowest":
            raw = slowest_rank(raw)
        for label, samples, how in variants(raw):
            profile, _ = combine_runs(samples, how, args.fabric)
            got = score(profile, groups, args.profile_rate)
            layouts = ", ".join(f"{k} {v:+.1%}" for k, v in got["layouts"].items())
            lines.append(
                f"| {raw.get('date', path)} | {label}{suffix} | {got['within']} of "
                f"{got['times']} | {got['median']:+.1%} | {layouts} | {got['largest']:+.0%} |"
            )
    emit("\n".join(lines) + "\n", args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
