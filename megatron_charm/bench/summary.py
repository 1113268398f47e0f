"""Turn the ranks' raw records into the benchmark's result: medians, spread, CCR, bytes, bound.

Pure (no torch.distributed): it works on the JSON rank 0 wrote, so results can be re-summarised.
"""

from __future__ import annotations

import statistics

from megatron_charm.bench.accounting import (
    classify,
    dependency_bound_s,
    llama3_bytes,
    lower_bound_s,
    method_bytes,
    method_plan,
    zigzag_ring_bytes,
)
from megatron_charm.bench.methods import doc_mask, plan_options
from megatron_charm.plan import Layout
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.validate import validate

MODES = ("fwd", "fwdbwd")
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: list[float]) -> dict[str, float]:
    """Median, min, max and the interquartile range of ``xs`` (seconds)."""
    if len(xs) >= 4:
        q = statistics.quantiles(xs, n=4)
        iqr = q[2] - q[0]
    else:
        iqr = max(xs) - min(xs) if xs else float("nan")
    return {"median": _med(xs), "min": min(xs), "max": max(xs), "iqr": iqr, "n": len(xs)}


def summarise(raw: dict, cfg: dict) -> dict:
    """The result dict (see docs/benchmarks.md for the fields)."""
    ranks = sorted(raw["ranks"], key=lambda r: r["cp_rank"])
    m, p = raw["layout"]
    layout = Layout(m, p)
    shape = AttnShape(
        cfg["batch"],
        cfg["seq_local"],
        cfg["heads"],
        cfg["kv_heads"],
        cfg["head_dim"],
        ITEMSIZE[cfg["dtype"]],
    )
    topology = cfg.get("topology", "shared")
    cross_bps = float(cfg.get("cross_bps") or 0)
    methods = cfg["methods"]
    out: dict = {"methods": {}, "layout": [m, p], "cross_bps": cross_bps, "topology": topology}

    # Sequential ring: CCR = sum of compute over sum of communication (over ranks), per iteration.
    n_it = len(ranks[0]["seq"])
    ccr = {"fwd": [], "bwd": [], "fwdbwd": []}
    pure = {"fwd": [], "bwd": [], "fwdbwd": []}
    for i in range(n_it):
        rows = [r["seq"][i] for r in ranks]
        # x: compute and waits of the real sequential run, then the transfers alone (null kernel)
        fc, bc = sum(x[0] for x in rows), sum(x[2] for x in rows)
        fm, bm = sum(x[4] for x in rows), sum(x[5] for x in rows)
        ccr["fwd"].append(fc / fm)
        ccr["bwd"].append(bc / bm)
        ccr["fwdbwd"].append((fc + bc) / (fm + bm))
        pure["fwd"].append(max(x[0] for x in rows))
        pure["bwd"].append(max(x[2] for x in rows))
        pure["fwdbwd"].append(max(x[0] + x[2] for x in rows))
    out["ccr"] = {k: _med(v) for k, v in ccr.items()}
    out["ccr_spread"] = {k: [min(v), max(v)] for k, v in ccr.items()}
    out["pure_compute_s"] = {k: _med(v) for k, v in pure.items()}
    out["ring_comm_alone_s"] = {
        "fwd": _med([max(r["seq"][i][4] for r in ranks) for i in range(n_it)]),
        "fwdbwd": _med([max(r["seq"][i][4] + r["seq"][i][5] for r in ranks) for i in range(n_it)]),
    }
    # CCR with the waits of the real sequential run as communication (includes peers' compute)
    out["ccr_with_waits"] = {
        "fwdbwd": _med(
            [
                sum(r["seq"][i][0] + r["seq"][i][2] for r in ranks)
                / sum(r["seq"][i][1] + r["seq"][i][3] for r in ranks)
                for i in range(n_it)
            ]
        )
    }

    # Bytes per link class, from the plans (and ring-flash-attention's algorithm). CHARM+'s plan
    # also gives the bound, so its validator reports serve both.
    mask = doc_mask(cfg, layout.cp_size * cfg["seq_local"])
    opts = plan_options(cfg)
    charm_plan = method_plan("charm", layout, cfg["causal"], shape, opts, mask)
    charm_reports = dict(zip(("fwd", "bwd"), validate(charm_plan), strict=True))
    charm_lb = {k: classify(r, shape, layout, topology) for k, r in charm_reports.items()}
    link_bytes = {}
    for name in methods:
        if name in ("ring-flash", "te-p2p"):
            lb = zigzag_ring_bytes(layout, shape, topology)
        elif name == "ring-flash-llama3":
            lb = llama3_bytes(layout, shape, topology)
        elif name == "usp":
            # the same algorithm as our a2a+p2p (Ulysses in a node, zigzag ring across nodes),
            # counted by its plan; yunchang's ring sends whole kv blocks where ours sends the
            # half a receiver uses, so its cross bytes are at least these
            lb = method_bytes("a2a+p2p", layout, cfg["causal"], shape, topology, opts, mask)
        elif name == "charm":
            lb = charm_lb
        else:
            lb = method_bytes(name, layout, cfg["causal"], shape, topology, opts, mask)
        link_bytes[name] = {k: v.as_dict() for k, v in lb.items()}
    out["byte_bound_s"] = {
        "fwd": lower_bound_s(_med(pure["fwd"]), charm_lb["fwd"].max_cross_link, cross_bps),
        "fwdbwd": lower_bound_s(
            _med(pure["fwdbwd"]),
            charm_lb["fwd"].max_cross_link + charm_lb["bwd"].max_cross_link,
            cross_bps,
        ),
    }
    # Note [The dependency-aware bound]; the passes add up (see docs/benchmarks.md)
    dep = {
        k: dependency_bound_s(charm_plan, r, k == "bwd", shape, topology, _med(pure[k]), cross_bps)
        for k, r in charm_reports.items()
    }
    bound = {
        "fwd": dep["fwd"],
        "fwdbwd": max(dep["fwd"] + dep["bwd"], out["byte_bound_s"]["fwdbwd"]),
    }
    out["lower_bound_s"] = bound
    out["cross_link_time_s"] = {
        "fwd": charm_lb["fwd"].max_cross_link * 8 / cross_bps if cross_bps else None,
        "fwdbwd": (charm_lb["fwd"].max_cross_link + charm_lb["bwd"].max_cross_link) * 8 / cross_bps
        if cross_bps
        else None,
    }

    for name in methods:
        res: dict = {"bytes": link_bytes[name]}
        for mode in MODES:
            per_it = list(zip(*(r["recs"][name][mode] for r in ranks), strict=True))
            walls = [max(x["wall"] for x in it) for it in per_it]
            res[mode] = _spread(walls)
            if "cpu" in per_it[0][0]:
                # process CPU time (all threads) summed over ranks: on an oversubscribed CPU
                # testbed it, not the wall time, says how much work a method does
                res[mode]["cpu_s"] = _med([sum(x["cpu"] for x in it) for it in per_it])
            if "compute" in per_it[0][0]:
                idle = [
                    _med([it[j]["wall"] - it[j]["compute"] for it in per_it])
                    for j in range(len(ranks))
                ]
                comp = [_med([it[j]["compute"] for it in per_it]) for j in range(len(ranks))]
                res[mode]["not_computing_s"] = idle
                res[mode]["compute_s"] = comp
            if "peak" in per_it[0][0]:
                res[mode]["peak_buffer_bytes"] = {
                    k: max(x["peak"].get(k, 0) for it in per_it for x in it) for k in ("fwd", "bwd")
                }
                res[mode]["sent_bytes"] = {
                    k: {
                        ch: sum(x["sent"].get(k, {}).get(ch, 0) for x in per_it[0])
                        for ch in sorted({c for x in per_it[0] for c in x["sent"].get(k, {})})
                    }
                    for k in ("fwd", "bwd")
                }
            # the bound is the dense problem's: no ratio under a mask
            dense = mask is None
            res[mode]["bound_ratio"] = res[mode]["median"] / bound[mode] if dense else None
        res["max_diff_vs_ref"] = max(max(r["agree"][name].values()) for r in ranks)
        res["agree"] = {
            k: max(r["agree"][name][k] for r in ranks) for k in ("out", "dq", "dk", "dv")
        }
        if ranks[0].get("ref_err"):
            res["ref_err"] = {
                k: max(r["ref_err"][name][k] for r in ranks) for k in ("out", "dq", "dk", "dv")
            }
        res["saved_bytes"] = {
            "total": max(r["saved"][name][0] for r in ranks),
            "beyond_inputs": max(r["saved"][name][1] for r in ranks),
        }
        out["methods"][name] = res

    baselines = [b for b in ("ring", "ring-flash", "te-p2p") if b in out["methods"]]
    for res in out["methods"].values():
        for mode in MODES:
            if baselines:
                best = min(out["methods"][b][mode]["median"] for b in baselines)
                res[mode]["speedup_vs_best_baseline"] = best / res[mode]["median"]
            if "ring" in out["methods"]:
                res[mode]["speedup_vs_ring"] = (
                    out["methods"]["ring"][mode]["median"] / res[mode]["median"]
                )
    out["baselines"] = baselines
    out["ref_method"] = next((x for x in methods if x in ("charm", "rm+", "merge", "ring")), None)
    return out


def timelines(raw: dict, method: str, mode: str = "fwd", iteration: int = -1) -> list[dict]:
    """Per-rank instruction events ``(pass, kind, channel, start, end)`` of one timed call, and
    the seconds from the call's start to its return (``wall``; ``None`` where not recorded)."""
    return [
        {
            "cp_rank": r["cp_rank"],
            "events": r["recs"][method][mode][iteration].get("events", []),
            "wall": r["recs"][method][mode][iteration].get("wall"),
        }
        for r in sorted(raw["ranks"], key=lambda r: r["cp_rank"])
    ]


def _mb(x: float) -> str:
    return f"{x / 2**20:.2f}"


def markdown(res: dict, cfg: dict) -> str:
    """A markdown table of one benchmark result."""
    m, p = res["layout"]
    rate = res["cross_bps"]
    head = (
        f"{m} x {p} {res['topology']}, cross {rate / 1e6:g} Mbit/s, "
        f"{'causal' if cfg['causal'] else 'non-causal'}, {cfg['dtype']}, b {cfg['batch']}, "
        f"s_local {cfg['seq_local']}, heads {cfg['heads']} (kv {cfg['kv_heads']}), "
        f"head dim {cfg['head_dim']}; {cfg['iters']} iterations after {cfg['warmup']} warm-up"
    )
    if cfg.get("docs") or cfg.get("mask_window"):
        docs = cfg.get("docs")
        shown = f"{len(docs)} documents" if docs else "one document"
        window = cfg.get("mask_window")
        head += f"; mask: {shown}" + (f", window {window}" if window else "")
    lines = [
        head,
        "",
        "| method | fwd median ms [min-max] | speedup | fwd+bwd median ms [min-max] | speedup "
        "| not computing fwd / fwd+bwd (ms, mean over ranks) | cross MB busiest link fwd / bwd "
        "| intra MB fwd / bwd (all ranks) | time / bound fwd, fwd+bwd |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["methods"].items():
        cells = [name]
        for mode in MODES:
            s = r[mode]
            cells.append(f"{s['median'] * 1e3:.0f} [{s['min'] * 1e3:.0f}-{s['max'] * 1e3:.0f}]")
            speedup = s.get("speedup_vs_best_baseline")
            cells.append("-" if speedup is None else f"{speedup:.2f}x")
        idle = []
        for mode in MODES:
            nc = r[mode].get("not_computing_s")
            idle.append(f"{statistics.mean(nc) * 1e3:.0f}" if nc else "-")
        cells.append(" / ".join(idle))
        b = r["bytes"]
        cells.append(f"{_mb(b['fwd']['max_cross_link'])} / {_mb(b['bwd']['max_cross_link'])}")
        cells.append(f"{_mb(b['fwd']['intra'])} / {_mb(b['bwd']['intra'])}")
        if r["fwd"]["bound_ratio"] is None:
            cells.append("-")
        else:
            cells.append(f"{r['fwd']['bound_ratio']:.2f}, {r['fwdbwd']['bound_ratio']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lb, pc, ct = res["lower_bound_s"], res["pure_compute_s"], res["cross_link_time_s"]
    bb = res.get("byte_bound_s", lb)
    lines += [
        "",
        f"Speedup is over the faster of {', '.join(res['baselines'])} (median times)."
        if res["baselines"]
        else "No baseline ran (ring, ring-flash): no speedup.",
        f"Ring attention run sequentially: CCR fwd {res['ccr']['fwd']:.2f}, bwd "
        f"{res['ccr']['bwd']:.2f}, fwd+bwd {res['ccr']['fwdbwd']:.2f}; pure compute (slowest "
        f"rank) fwd {pc['fwd'] * 1e3:.0f} ms, fwd+bwd {pc['fwdbwd'] * 1e3:.0f} ms; communication "
        f"alone (slowest rank) fwd {res['ring_comm_alone_s']['fwd'] * 1e3:.0f} ms, fwd+bwd "
        f"{res['ring_comm_alone_s']['fwdbwd'] * 1e3:.0f} ms.",
        "Lower bound (CHARM+'s plan; pure compute, cross link bytes / rate, and the first "
        "and last pieces' chains, Note [The dependency-aware bound]): fwd "
        f"{lb['fwd'] * 1e3:.0f} ms, fwd+bwd {lb['fwdbwd'] * 1e3:.0f} ms; bytes alone "
        f"{bb['fwd'] * 1e3:.0f} / {bb['fwdbwd'] * 1e3:.0f} ms"
        + (
            f" (cross-link time {ct['fwd'] * 1e3:.0f} / {ct['fwdbwd'] * 1e3:.0f} ms)."
            if ct["fwd"] is not None
            else " (no cross rate: compute only)."
        ),
        *(
            [
                "Process CPU time per call, summed over ranks (ms, fwd / fwd+bwd): "
                + ", ".join(
                    f"{n} {r['fwd']['cpu_s'] * 1e3:.0f} / {r['fwdbwd']['cpu_s'] * 1e3:.0f}"
                    for n, r in res["methods"].items()
                )
                + "."
            ]
            if all("cpu_s" in r["fwd"] for r in res["methods"].values())
            else []
        ),
        *(
            [
                "With a mask, the sequential ring and the lower bound above are the dense "
                "problem's (for scale only), and time / bound is not reported; cross and intra MB "
                "are those of the plans pruned to the mask."
            ]
            if cfg.get("docs") or cfg.get("mask_window")
            else []
        ),
        "Agreement with "
        + str(res["ref_method"])
        + " (max |diff| of out, dq, dk, dv): "
        + ", ".join(f"{n} {r['max_diff_vs_ref']:.1e}" for n, r in res["methods"].items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


def median_iteration(raw: dict, method: str, mode: str) -> int:
    """Index of the timed iteration whose (slowest-rank) time is the median."""
    ranks = raw["ranks"]
    n = len(ranks[0]["recs"][method][mode])
    walls = [max(r["recs"][method][mode][i]["wall"] for r in ranks) for i in range(n)]
    return sorted(range(n), key=lambda i: walls[i])[n // 2]


def format_timeline(raw: dict, method: str, mode: str, iteration: int | None = None) -> str:
    """Per-rank, per-instruction timeline (ms from the call's start) of one timed call of one of
    our methods, plus per-channel wait totals: where each rank waited, and on what."""
    it = median_iteration(raw, method, mode) if iteration is None else iteration
    lines = [f"{method} {mode}, timed iteration {it} (median); times in ms from the call's start"]
    for tl in timelines(raw, method, mode, it):
        evs = tl["events"]
        if not evs:
            raise ValueError(f"no trace for {method!r}: only our methods are traced (--raw output)")
        waits: dict[str, float] = {}
        compute = 0.0
        lines.append(f"cp_rank {tl['cp_rank']}:")
        for pas, kind, ch, s, e in evs:
            lines.append(
                f"  {pas} {kind:8s} {ch:9s} {s * 1e3:8.1f} {e * 1e3:8.1f} {(e - s) * 1e3:7.1f}"
            )
            if kind == "Wait":
                waits[f"{pas}:{ch}"] = waits.get(f"{pas}:{ch}", 0.0) + (e - s)
            elif kind in ("Compute", "Merge"):
                compute += e - s
        lines.append(
            f"  compute {compute * 1e3:.0f} ms; waits "
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in waits.items())
        )
        if tl["wall"] is not None:  # the call's own work after its last instruction
            last = max(e for *_, e in evs)
            lines.append(
                f"  returned at {tl['wall'] * 1e3:.1f} ms, {(tl['wall'] - last) * 1e3:.1f} ms "
                "after its last instruction"
            )
    return "\n".join(lines) + "\n"
