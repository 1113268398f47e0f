"""Validation (b): predicted vs measured times of the attention benchmark on the CPU testbed.

The benchmark (``megatron-charm-bench attention``) writes one JSON per configuration. The
simulator is calibrated from that JSON and the testbed's link probe only:

* per-block compute: the benchmark's pure-compute times of the slowest rank (forward and
  forward+backward), divided by the blocks a rank computes (``n``, each half a full block when
  causal) -> :class:`~megatron_charm.sim.compute.CalibratedCompute`;
* cross-node link: the probe's measured per-link rate (``cross`` phase) when a probe JSON is
  given; else the rate the ring's transfers reached when the benchmark ran them alone
  (``ring_comm_alone_s``: ``n - 1`` whole-kv steps, each as slow as its cross-node hop); else the
  configured tc rate in the result (``cross_bps``);
* intra-node link: the probe's ``intra`` phase (loopback), else ``--intra-gbps``;
* layout and sharing (``shared``/``rails``) and the problem shape from the result's config.

Latencies and the merge bandwidth are fixed assumptions (``--intra-lat-us``, ``--cross-lat-us``,
``--merge-gbps``), not fitted.

With ``--profile PROFILE.json`` (from ``megatron-charm-sim calibrate`` on the same testbed) none of
that is read from the results: links and compute come from the profile alone, so every row is
predicted without looking at its own measurements. Results measured at other cross-link rates
than the profile (a sweep) take ``--profile-rate`` (the tc rate the profile was calibrated at):
each result's cross link is then the profile's measured rate scaled by the result's configured
rate over that one, so the goodput the calibration measured carries over.

A profile describes the testbed it was calibrated on; a result may come from another shape of
the same testbed. :func:`profile_for` adapts it, from the result's own configuration only: the
sharing of its shaped cross links (``rails``: one per rail; ``shared``: one; an unshaped
loopback result keeps the profile's), and, because every rank of
the testbed runs on one host, its compute: a result with more ranks than the calibration shares
the same cores among more processes, so each rank's block and merge rates scale by the ratio of
the rank counts (the calibration's ranks already fill the host's cores on the 2-core machine
this testbed targets). A profile that models the shared host itself (``shared_slots``, Note
[Ranks sharing a host]) needs no scaling: the replay shares the host among however many ranks
compute.

The testbed joins each pair of nodes by its own links (docs/testbed.md), so every replay here
runs on that mesh (``cross_mesh``, Note [Links and contention]): on four nodes a node sends to
the three others at the full rate each, where one NIC per node would split it. Each link's tbf
queue serves transfers in the order they arrive, so the replay's cross links do too
(``cross_fifo``).

Note [A profile per rank count]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``calibrate`` measures a CPU host's work around the kernels (Note [Host work of a call] in
megatron_charm/sim/profile.py) and its kernels inside passes (Note [Blocks in a pass]) with every
rank of its own layout at once, and what it measures holds for that many processes on the host.
On the 2-core testbed (an Intel Xeon, 2026-12-06 15:50 UTC, ``scripts/bench/blocks_in_pass.py``,
charm at 200 Mbit/s, 512 tokens per rank, non-causal), against one 2 x 2 profile, a pass's
calling thread outside its kernel took 1.07 times what the profile charges on 2 x 2, 1.86 times
on 4 x 2 and 1.57 times on 2 x 4; the whole pass 1.00, 1.27 and 1.13 times. So a 2 x 2 profile
charged eight ranks for four's work, and the sweeps' eight-rank points came out too fast: their
mean error 8-13 points below the four-rank points' on three sweeps, charm's eight-rank times 16%
too fast in the median (docs/results/calibrated-2x2.md, "A profile per rank count"). Processes
crowding two cores evict each other's caches and wake cold; work outside the kernel, memory-
and interpreter-bound, suffers most. A synthetic probe of that (processes running a merge,
buffer packing and small tensor operations, ``k`` at a time) did not reproduce what the passes
pay, and was not kept. A profile calibrated on 2 x 4 charges the same eight-rank passes within
3% (2 x 4) and 12% (4 x 2).

So the replay takes one profile per rank count, each calibrated on as many ranks as the results
it predicts (``--profile`` more than once: each result takes the first profile calibrated on
as many ranks as it ran, else the first of the nearest count), as a GPU cluster is calibrated
as one job of the CP group's shape.

Repeated runs. A sweep names each point's file after the point (``scripts/bench/sweep.py``), so
result files with the same name from several sweep folders are runs of one point; they must
have the same configuration (``ValueError`` otherwise). The point is predicted once (from the
first run where the prediction reads the results) and each time is compared with the median of
the runs' medians; the table lists every run's time and their spread (largest over smallest,
minus one), and the header gives the spread over all points: an error inside it is below what
this host repeats (Note [Repeatability]).

Note [Repeatability]
~~~~~~~~~~~~~~~~~~~~
The testbed runs every rank on one 2-core host whose speed is not constant. On a shared virtual
machine the same point measured two hours apart differed by more than the +-20% the calibrated
prediction aims at (charm's forward on 2 x 2 causal at 200 Mbit/s: 70 ms at 22:58 UTC, 51 and 52 ms
in two sweeps after midnight), while another repeated within 5% (2 x 4 rails non-causal at 1
Gbit/s: 196, 205 and 203 ms). The two later sweeps, 17 minutes apart, differed by 3% in the median
time and by up to 31% (a2a+p2p's forward on 2 x 2 causal at 1 Gbit/s: 51 and 39 ms;
docs/results/calibrated-2x2.md). One run cannot tell a noisy point from a model error; runs of the
same point can: a miss outside the runs' spread is the model's, one inside it may be the host's.

Run: ``python -m megatron_charm.sim.testbed docs/results/attention-*.json
[--probe PROBE.json] [--out docs/results/sim_validation_testbed.md]``; ``--timeline METHOD``
prints the replayed forward of one method per rank instead, to set beside the measured one
(``megatron-charm-bench timeline RAW.json`` of an ``attention --raw`` run); with ``--measured
RAW.json`` as well it prints each rank's edges of that pass, measured against replayed (Note
[Edges of a pass] in :mod:`megatron_charm.sim.timeline_edges`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_charm.bench.provenance import host_differences
from megatron_charm.plan import METHODS, PlanOptions
from megatron_charm.plan.options import PLAN_KEYS
from megatron_charm.plan.payloads import AttnShape, payload_bytes
from megatron_charm.plan.types import Kind, Layout, Part, Payload, Wire
from megatron_charm.sim.compute import CalibratedCompute, ComputeModel
from megatron_charm.sim.predict import Problem, predict
from megatron_charm.sim.profile import Profile, load_profile
from megatron_charm.sim.repeats import unsteady
from megatron_charm.sim.timeline_edges import format_edges, measured_edges, replayed_edges
from megatron_charm.sim.topology import Topology, parse_gpus
from megatron_charm.testbed.config import parse_rate

ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Calibration:
    """What the simulator takes from one benchmark result."""

    topo: Topology
    problem: Problem
    compute: ComputeModel
    source: str
    """Where the link rates came from."""


def _probe_rates(probe: dict) -> tuple[float | None, float | None]:
    """``(intra, cross)`` bytes/s from a probe JSON (``megatron_charm.testbed.probe``)."""
    intra = cross = None
    for ph in probe.get("phases", []):
        if ph.get("name") == "intra":
            intra = ph["aggregate_bps"] / 8
        elif ph.get("name") == "cross":
            cross = ph.get("per_link_bps", ph["aggregate_bps"]) / 8
    return intra, cross


def profile_for(profile: Profile, result: dict, profile_rate: str | None = None) -> Profile:
    """``profile`` adapted to the testbed shape of ``result`` (see the module docstring)."""
    cfg = result["config"]
    m, p = result["layout"]
    nics, cross = profile.nics_per_node, profile.cross_bw
    rate = float(result.get("cross_bps") or 0)
    if rate > 0:  # a shaped cross link: its sharing is the result's testbed topology
        nics = 0 if cfg.get("topology", "shared") == "rails" else 1
        if profile_rate:
            cross *= rate / parse_rate(profile_rate, "--profile-rate")
    compute = dict(profile.compute)
    pm, pp = parse_gpus(profile.gpus)
    share = (m * p) / (pm * pp)
    if share > 1 and compute.get("kind") == "fitted" and not compute.get("shared_slots"):
        for key in ("fwd_flops_per_s", "bwd_flops_per_s", "mem_bw"):
            compute[key] = compute[key] / share
        for key in ("fwd_overhead", "bwd_overhead"):
            compute[key] = compute[key] * share
    return replace(profile, cross_bw=cross, nics_per_node=nics, compute=compute)


def pick_profile(profiles: Sequence[Profile], result: dict) -> int:
    """Index of the profile of ``profiles`` (non-empty) for ``result``: the first calibrated on
    as many ranks as the result ran, else the first of the nearest count (Note [A profile per
    rank count])."""
    m, p = result["layout"]

    def ranks(prof: Profile) -> int:
        pm, pp = parse_gpus(prof.gpus)
        return pm * pp

    return min(range(len(profiles)), key=lambda i: (abs(ranks(profiles[i]) - m * p), i))


def profile_rates(count: int, rates: Sequence[str]) -> list[str | None]:
    """``--profile-rate`` for each of ``count`` profiles: none, one for all, or one each."""
    if rates and not count:
        raise ValueError("--profile-rate scales a profile's cross link: pass --profile too")
    if len(rates) in (0, 1):
        return [rates[0] if rates else None] * count
    if len(rates) != count:
        raise ValueError(
            f"{len(rates)} --profile-rate for {count} --profile: give one rate for every "
            "profile, or one per profile in the same order"
        )
    return list(rates)


def calibrate(
    result: dict,
    probe: dict | None = None,
    intra_gbps: float | None = None,
    intra_lat_us: float = 50.0,
    cross_lat_us: float = 200.0,
    merge_gbps: float = 5.0,
    profile: Profile | None = None,
) -> Calibration:
    """Topology, problem and compute model of one benchmark result (see module docstring)."""
    cfg = result["config"]
    m, p = result["layout"]
    n = m * p
    causal = bool(cfg.get("causal", True))
    problem = Problem(
        cfg["batch"],
        cfg["seq_local"] * n,
        cfg["heads"],
        cfg["head_dim"],
        cfg.get("kv_heads") or cfg["heads"],
        causal,
        ITEMSIZE[cfg.get("dtype", "bf16")],
    )
    if profile is not None:
        topo = _as_built(profile.topology(m, p))
        return Calibration(topo, problem, profile.compute_model(), "profile")
    intra, cross = _probe_rates(probe) if probe else (None, None)
    source = "probe"
    alone = (result.get("ring_comm_alone_s") or {}).get("fwd")
    if cross is None and alone and m > 1 and n > 1:
        kv = payload_bytes(
            Payload(Kind.KV, 0, Part.FULL),
            AttnShape(
                cfg["batch"],
                cfg["seq_local"],
                cfg["heads"],
                cfg.get("kv_heads") or cfg["heads"],
                cfg["head_dim"],
                ITEMSIZE[cfg.get("dtype", "bf16")],
            ),
            Wire.INPUT,
        )
        cross, source = (n - 1) * kv / alone, "ring transfers alone"
    if cross is None:
        cross, source = float(result.get("cross_bps") or 0) / 8, "configured"
    if intra is None:
        if intra_gbps is None:
            raise ValueError(
                "no intra-node rate: pass --probe PROBE.json (megatron_charm.testbed.probe) or "
                "--intra-gbps with the measured loopback rate in GB/s"
            )
        intra = intra_gbps * 1e9
    if cross <= 0:
        cross = intra  # a loopback run has no slow link
    topo = Topology(
        m,
        p,
        intra / 1e9,
        cross / 1e9,
        intra_lat=intra_lat_us * 1e-6,
        cross_lat=cross_lat_us * 1e-6,
        fabric="nvlink",  # loopback TCP: concurrent streams of a rank do not split a fixed rate
        cross_links=result.get("topology", "shared"),
    )
    topo = _as_built(topo)
    area = 0.5 if causal else 1.0
    pure = result["pure_compute_s"]
    fwd_block = pure["fwd"] / (n * area)
    bwd_block = (pure["fwdbwd"] - pure["fwd"]) / (n * area)
    compute = CalibratedCompute(fwd_block, bwd_block, mem_bw=merge_gbps)
    return Calibration(topo, problem, compute, source)


def _as_built(topo: Topology) -> Topology:
    """``topo`` on the testbed's cross links: a mesh of node pairs, each link's queue served in
    arrival order (see the module docstring)."""
    return replace(topo, cross_mesh=True, cross_fifo=True)


def _plan_options(result: dict) -> PlanOptions:
    """The plan options the benchmark ran with (its method aside)."""
    return PlanOptions(**{k: result["config"][k] for k in PLAN_KEYS if k in result["config"]})


def _median_or_none(values) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def compare(
    result: dict,
    probe: dict | None = None,
    cal: Calibration | None = None,
    repeats: Sequence[dict] = (),
    **kw: Any,
) -> list[dict]:
    """Rows of predicted vs measured median seconds per method and pass (fwd, fwd+bwd);
    ``cal``: an already computed :func:`calibrate` of ``result`` (else made from ``probe``,
    ``kw``: :func:`calibrate`'s keywords ``intra_gbps``, ``intra_lat_us``, ``cross_lat_us``,
    ``merge_gbps``, ``profile``; unread when ``cal`` is given); ``repeats``: further runs of the
    same point (Note [Repeatability]): the measured time is then the median of every run's
    median, ``runs_s`` lists them and ``spread`` is the largest over the smallest, minus one. A
    method missing from a repeat is compared with the runs that have it, and one that only a
    repeat ran is compared too (so a later run can add a method, such as the one ``auto``
    picks, to a point measured before). Each row also holds
    ``host_work_s``, the seconds alone the replay charged the shared host for every rank
    (``PassResult.host_work``; 0 without a shared host), and ``cpu_s``, the CPU seconds the
    ranks spent in the call (the median of the runs that recorded it, else ``None``)."""
    cal = cal if cal is not None else calibrate(result, probe, **kw)
    methods = [m for m in METHODS if any(m in r["methods"] for r in (result, *repeats))]
    pred = predict(
        cal.topo, cal.problem, cal.compute, tuple(methods), options=_plan_options(result)
    )
    rows = []
    everyone = cal.topo.num_nodes * cal.topo.ranks_per_node
    for method in methods:
        mp = pred.methods[method]
        # the replay's host work for every rank (a symmetric replay runs some of them)
        work = [p.host_work * everyone / len(p.ranks) for p in (mp.forward, mp.backward)]
        for tag, predicted, charged in (
            ("fwd", mp.forward.makespan, work[0]),
            ("fwdbwd", mp.total, sum(work)),
        ):
            runs = [
                r["methods"][method][tag]["median"]
                for r in (result, *repeats)
                if method in r["methods"]
            ]
            measured = statistics.median(runs)
            rows.append(
                {
                    "method": method,
                    "pass": tag,
                    "measured_s": measured,
                    "predicted_s": predicted,
                    "error": predicted / measured - 1.0,
                    "runs_s": runs,
                    "spread": max(runs) / min(runs) - 1.0,
                    "host_work_s": charged,
                    "cpu_s": _median_or_none(
                        r["methods"][method][tag].get("cpu_s")
                        for r in (result, *repeats)
                        if method in r["methods"]
                    ),
                }
            )
    return rows


def _replayed_forward(result: dict, cal: Calibration, method: str):
    """The replayed forward of ``method`` on ``result``'s point, recorded per rank."""
    if method not in result["methods"]:
        raise ValueError(
            f"--timeline {method!r}: the result has no such method (it has "
            f"{', '.join(result['methods'])}); pick one of them"
        )
    pred = predict(
        cal.topo,
        cal.problem,
        cal.compute,
        (method,),
        options=_plan_options(result),
        record=True,
    )
    return pred.methods[method].forward


def replay_timeline(result: dict, cal: Calibration, method: str) -> str:
    """The replayed forward of ``method`` on ``result``'s point, per rank: each block (``C``),
    merge (``M``), host work (``H``) and wait (``W``), and each exchange's transfers (``X``, from
    its start to its completion), in ms from the call's start; the replay's side of
    ``megatron-charm-bench timeline``."""
    fwd = _replayed_forward(result, cal, method)
    lines = [f"{method} fwd, replayed: {fwd.makespan * 1e3:.1f} ms"]
    for r in fwd.ranks:
        events = [*r.timeline, *((s, e, f"X {ch}") for s, e, ch in r.transfers)]
        lines.append(f"cp_rank {r.cp_rank}:")
        lines += [
            f"  {label:26s} {s * 1e3:8.1f} {e * 1e3:8.1f} {(e - s) * 1e3:7.1f}"
            for s, e, label in sorted(events, key=lambda x: (x[0], x[1]))
        ]
    return "\n".join(lines) + "\n"


def compare_edges(result: dict, cal: Calibration, method: str, raw: dict) -> str:
    """Each rank's edges of ``method``'s forward, measured in ``raw`` (a ``--raw`` file of the
    same point) against replayed (Note [Edges of a pass] in
    :mod:`megatron_charm.sim.timeline_edges`)."""
    fwd = _replayed_forward(result, cal, method)
    measured = measured_edges(raw, method)
    table = format_edges(measured, replayed_edges(fwd.ranks))
    wall = max(e.end for e in measured)
    return (
        f"{method} fwd: measured {wall * 1e3:.1f} ms (this call), replayed "
        f"{fwd.makespan * 1e3:.1f} ms\n\n{table}"
    )


#: Config keys that may differ between runs of one point (Note [Repeatability]).
RUN_KEYS = ("methods", "iters", "warmup", "timeout_s")


def group_runs(paths: Sequence[str]) -> list[tuple[str, list[tuple[str, dict]]]]:
    """``paths`` grouped into points by file name, in first-seen order: ``(name, [(path,
    result), ...])``. ``ValueError`` when two runs of one name differ in configuration."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    for path in paths:
        with open(path) as fh:
            result = json.load(fh)
        groups.setdefault(os.path.basename(path), []).append((path, result))
    for name, runs in groups.items():
        first_path, first = runs[0]
        for path, other in runs[1:]:
            a, b = (
                {k: v for k, v in r["config"].items() if k not in RUN_KEYS} for r in (first, other)
            )
            if a != b or first.get("layout") != other.get("layout"):
                diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
                raise ValueError(
                    f"{path} and {first_path} share the name {name!r} but differ in "
                    f"{diff or ['layout']}: files of one name are runs of one point (Note "
                    "[Repeatability]); rename one of them"
                )
    return list(groups.items())


def auto_verdict(result: dict, cal: Calibration, profile: Profile, rows: list[dict]) -> dict:
    """What ``method="auto"`` picks on ``profile`` for this result's shape, and how far its
    measured fwd+bwd time is from the measured fastest of the methods, both as :func:`compare`
    gave them in ``rows`` (the median over a point's runs)."""
    from megatron_charm.auto import choose_method

    m, p = result["layout"]
    shape = cal.problem.shape(m * p)
    picked = choose_method(
        profile, Layout(m, p), shape, cal.problem.causal, _plan_options(result)
    ).method
    measured = {r["method"]: r["measured_s"] for r in rows if r["pass"] == "fwdbwd"}
    fastest = min(measured, key=measured.__getitem__)
    over = measured[picked] / measured[fastest] - 1.0 if picked in measured else None
    return {"picked": picked, "fastest": fastest, "over_fastest": over}


def error_summary(rows: list[dict]) -> str:
    """One sentence: the times within +-20% per CP size and each method's median error, of
    :func:`compare` rows that carry the result's ``ranks``."""
    sizes = sorted({r["ranks"] for r in rows})
    per_size = "; ".join(
        f"{sum(abs(r['error']) <= 0.20 for r in rows if r['ranks'] == n)} of "
        f"{sum(r['ranks'] == n for r in rows)} on {n} ranks"
        for n in sizes
    )
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    medians = ", ".join(
        f"{m} {statistics.median(r['error'] for r in rows if r['method'] == m):+.0%}"
        for m in methods
    )
    return f"Within +-20%: {per_size}. Median error per method: {medians}."


def markdown(name: str, result: dict, rows: list[dict], cal: Calibration) -> str:
    t, c = cal.topo, cal.compute
    if isinstance(c, CalibratedCompute):
        blocks = f"block fwd {c.fwd_block * 1e3:.1f} ms, bwd {c.bwd_block * 1e3:.1f} ms"
    else:
        blocks = "compute from the profile"
    lines = [
        f"### {name}",
        "",
        f"{t.num_nodes}x{t.ranks_per_node} {t.cross_links}; intra {t.intra_bw:.3g} GB/s, cross "
        f"{t.cross_bw * 1e3:.3g} MB/s ({cal.source}; configured "
        f"{float(result.get('cross_bps') or 0) / 8e6:.3g} MB/s); {blocks}.",
        "",
    ]
    repeated = any(len(r.get("runs_s", ())) > 1 for r in rows)
    if repeated:
        lines += [
            "| method | pass | measured ms (median of runs) | runs ms | spread | predicted ms "
            "| error |",
            "|---|---|---|---|---|---|---|",
        ]
    else:
        lines += [
            "| method | pass | measured ms | predicted ms | error |",
            "|---|---|---|---|---|",
        ]
    for r in rows:
        miss = "" if abs(r["error"]) <= 0.25 else " (miss)"
        runs = ""
        if repeated:
            each = ", ".join(f"{x * 1e3:.0f}" for x in r["runs_s"])
            runs = f"{each} | {r['spread']:.0%} | "
        lines.append(
            f"| {r['method']} | {r['pass']} | {r['measured_s'] * 1e3:.0f} | {runs}"
            f"{r['predicted_s'] * 1e3:.0f} | {r['error']:+.0%}{miss} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="benchmark result JSON files")
    ap.add_argument("--probe", help="link probe JSON of the same testbed")
    ap.add_argument("--intra-gbps", type=float, help="loopback rate, GB/s (without --probe)")
    ap.add_argument("--intra-lat-us", type=float, default=50.0)
    ap.add_argument("--cross-lat-us", type=float, default=200.0)
    ap.add_argument("--merge-gbps", type=float, default=5.0)
    ap.add_argument(
        "--profile",
        action="append",
        help="predict from this calibrate profile alone (no per-row data); given more than "
        "once, each result takes the profile calibrated on its number of ranks (else the "
        "nearest; Note [A profile per rank count])",
    )
    ap.add_argument(
        "--profile-rate",
        action="append",
        help="tc rate the profile was calibrated at (e.g. 100mbit): scale its cross link to "
        "each result's configured rate; once for every profile, or once per --profile in order",
    )
    ap.add_argument("--out", help="write the Markdown here")
    ap.add_argument(
        "--timeline",
        metavar="METHOD",
        help="print the replayed forward of METHOD per rank, for each result, instead",
    )
    ap.add_argument(
        "--measured",
        metavar="RAW",
        help="with --timeline and one result: a --raw file of the same point; print each "
        "rank's edges of the pass measured against replayed instead (Note [Edges of a pass])",
    )
    args = ap.parse_args(argv)
    raw = None
    if args.measured:
        if not args.timeline or len(args.results) != 1:
            raise ValueError(
                f"--measured {args.measured}: compares one point's pass; give it with "
                f"--timeline METHOD and one result (got {len(args.results)} results"
                f"{'' if args.timeline else ', no --timeline'})"
            )
        with open(args.measured) as fh:
            raw = json.load(fh)
    probe = None
    if args.probe:
        with open(args.probe) as fh:
            probe = json.load(fh)
    kw = dict(
        intra_gbps=args.intra_gbps,
        intra_lat_us=args.intra_lat_us,
        cross_lat_us=args.cross_lat_us,
        merge_gbps=args.merge_gbps,
        profile=None,
    )
    profiles = [load_profile(p) for p in args.profile or ()]
    rates = profile_rates(len(profiles), args.profile_rate or [])
    parts: list[str] = []
    n_auto = 0
    hosts = {"same": 0, "differ": 0, "not recorded": 0}
    groups = group_runs(args.results)
    every: list[dict] = []
    for name, runs in groups:
        result = runs[0][1]
        repeats = [r for _, r in runs[1:]]
        base = None
        if profiles:
            chosen = pick_profile(profiles, result)
            base = profiles[chosen]
            kw["profile"] = profile_for(base, result, rates[chosen])
        cal = calibrate(result, probe, **kw)
        if args.timeline:
            if raw is not None:
                print(f"### {name}\n{compare_edges(result, cal, args.timeline, raw)}")
                continue
            print(f"### {name}\n{replay_timeline(result, cal, args.timeline)}")
            continue
        rows = compare(result, cal=cal, repeats=repeats)
        ranks = result["layout"][0] * result["layout"][1]
        every += [dict(r, ranks=ranks) for r in rows]
        title = name if not repeats else f"{name} ({len(runs)} runs)"
        part = markdown(title, result, rows, cal)
        if len(profiles) > 1:  # which one this point took
            part += f"\n\nProfile: {base.name} ({base.gpus})."
        if base is not None:
            others: list[str] = []  # each differing run's differences, once per point
            for _, run in runs:
                diff = host_differences(run.get("host"), base.provenance.get("host"))
                key = "not recorded" if diff == ["not recorded"] else "differ" if diff else "same"
                hosts[key] += 1
                if key == "differ":
                    others.append("; ".join(diff))
            if others:
                count = f"{len(others)} of {len(runs)} runs; " if len(runs) > 1 else ""
                part += (
                    f"\n\n**Measured on another host than the profile's** ({count}"
                    f"{'; '.join(dict.fromkeys(others))}): this row compares two machines; "
                    "calibrate on the result's host."
                )
        if kw["profile"] is not None:
            v = auto_verdict(result, cal, kw["profile"], rows)
            over = "not measured" if v["over_fastest"] is None else f"{v['over_fastest']:+.1%}"
            n_auto += v["over_fastest"] is not None and v["over_fastest"] <= 0.05
            part += (
                f"\n\nauto picks **{v['picked']}**; measured fastest fwd+bwd: {v['fastest']}; "
                f"auto's pick against it: {over}."
            )
        parts.append(part)
    if args.timeline:
        return 0
    n_ok = sum(abs(r["error"]) <= 0.25 for r in every)
    n_20 = sum(abs(r["error"]) <= 0.20 for r in every)
    spreads = [r["spread"] for r in every if len(r["runs_s"]) > 1]
    head = (
        f"Generated {datetime.date.today().isoformat()}: {len(groups)} configurations, "
        f"{n_ok} of {len(every)} predicted times within +-25% of the measured medians ({n_20} "
        "within +-20%). Unit: one call of the attention, its forward and its forward+backward, the "
        "slowest rank's time per iteration (median over the iterations); each configuration "
        "states its links and compute."
    )
    if profiles:
        names = ", ".join(f"{p.name} ({p.gpus})" for p in profiles)
        each = "; each result on the profile of its rank count, else the nearest"
        head += (
            f" Profile{'s' if len(profiles) > 1 else ''}: {names} (nothing taken from the "
            f"results{each if len(profiles) > 1 else ''}). auto's pick is "
            f"within 5% of the measured fastest at {n_auto} of {len(groups)} points. "
            f"Hosts (CPU, cores, instruction sets, GPU, torch): {hosts['same']} of the results "
            f"on the profile's, {hosts['differ']} on another, {hosts['not recorded']} not "
            "recorded."
        )
        for prof in profiles:
            moved = unsteady(prof.fit_error) if prof.measured else []
            if moved:  # Note [A calibration's drift], Note [Repeated calibrations]
                head += f" The calibration of {prof.gpus} says: {'; '.join(moved)}."
    head += " " + error_summary(every)
    if spreads:
        head += (
            f" Runs: {len(args.results)} result files, {sum(len(r) > 1 for _, r in groups)} "
            "points run more than once; between the runs of a point a time differs by "
            f"{statistics.median(spreads):.0%} in the median and up to {max(spreads):.0%} "
            "(Note [Repeatability] in megatron_charm/sim/testbed.py)."
        )
    text = "\n\n".join([head, *parts]) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
