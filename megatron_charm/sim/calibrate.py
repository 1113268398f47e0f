"""``megatron-charm-sim calibrate``: measure this cluster's kernels and links, write a profile.

Examples::

    # on a GPU cluster, as one job of the CP group's shape (NCCL):
    torchrun --nnodes 2 --nproc-per-node 8 ... -m megatron_charm.sim calibrate \\
        --launcher env --device cuda --out h100-2x8.json
    # on the emulated CPU testbed (root), or on plain local processes:
    python -m megatron_charm.sim calibrate --nodes 2 --ranks-per-node 2 --cross-rate 100mbit \\
        --out testbed.json
    python -m megatron_charm.sim calibrate --launcher loopback --out loopback.json

Then ``megatron-charm-sim --profile testbed.json ...``, ``advise --profile ...`` and
``--cp-comm-type auto`` use the profile. What is measured and how it is fitted:
Note [Fitting a profile] in :mod:`megatron_charm.sim.profile`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from dataclasses import replace
from datetime import datetime, timezone

from megatron_charm.bench.provenance import host
from megatron_charm.constants import DEFAULT_TIMEOUT_S
from megatron_charm.sim.predict import Problem, predict
from megatron_charm.sim.profile import Profile, fit_profile
from megatron_charm.sim.repeats import (
    COMBINE,
    pick_repeat,
    pool_runs,
    repeat_summary,
    speed_drift,
    split_runs,
    unsteady,
)
from megatron_charm.sim.topology import FABRICS, parse_gpus


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r} must be a comma-separated list of positive integers")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="megatron-charm-sim calibrate",
        description="Time block kernels, merges and P2P transfers on real ranks and fit a "
        "profile for --profile and --cp-comm-type auto.",
    )
    ap.add_argument("--out", required=True, help="where to write the profile JSON")
    ap.add_argument(
        "--from-raw",
        metavar="RAW.json",
        default=None,
        help="fit the raw samples that an earlier calibrate wrote with --raw instead of "
        "measuring (every measuring option is then unused; --combine and --fabric apply)",
    )
    ap.add_argument(
        "--run",
        type=int,
        default=None,
        metavar="K",
        help="with --from-raw: fit the K-th run (1-based) of a --repeat calibration alone",
    )
    ap.add_argument("--launcher", choices=("testbed", "loopback", "env"), default="testbed")
    ap.add_argument("--nodes", type=int, default=2, help="nodes (testbed, loopback)")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node")
    ap.add_argument("--topology", choices=("shared", "rails"), default="shared", help="testbed")
    ap.add_argument("--cross-rate", default="100mbit", help="testbed cross link rate")
    ap.add_argument("--preset", default=None, help="testbed: l20|h20|h100 instead of --cross-rate")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--kernel", default=None, help="block kernel (default by device and dtype)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8, help="heads of the timed blocks")
    ap.add_argument(
        "--kernel-heads",
        default="1",
        help="also time the blocks on these head counts (comma-separated): a head-split "
        "method's blocks run on a fraction of the heads",
    )
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", default="256,512,1024,2048", help="block sizes (tokens)")
    ap.add_argument(
        "--sizes", default="65536,262144,1048576,4194304", help="P2P message sizes (bytes)"
    )
    ap.add_argument("--reps", type=int, default=5, help="timings per point (median counts)")
    ap.add_argument(
        "--in-pass-rounds",
        type=int,
        default=None,
        help="CPU hosts: rounds of whole passes whose kernel CPU gives the blocks' factor in a "
        "pass (median counts; default 5, Note [Blocks in a pass])",
    )
    ap.add_argument(
        "--fabric",
        choices=FABRICS,
        default="nvlink",
        help="intra-node fabric to assume (not measured): nvlink or pcie; with pcie and 4+ "
        "ranks per node the PCIe domain the node's GPUs share is measured",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    ap.add_argument("--timeout", type=float, default=2 * DEFAULT_TIMEOUT_S, help="seconds")
    ap.add_argument("--raw", default=None, help="also keep the raw samples here")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="calibrate this many times in a row and combine the runs (--combine); the spread "
        "of their own fits joins the profile's known error (--timeout applies to each run)",
    )
    ap.add_argument(
        "--combine",
        choices=COMBINE,
        default="median-run",
        help="with --repeat: fit the median run by its largest block alone (median-run), or the "
        "median of every timing over the runs (pool); Note [Repeated calibrations]",
    )
    return ap


def config_from_args(args: argparse.Namespace) -> dict:
    if args.reps < 1:
        raise ValueError(f"--reps {args.reps} must be >= 1")
    if args.repeat < 1:
        raise ValueError(f"--repeat {args.repeat} must be >= 1 (1: calibrate once)")
    if args.run is not None and not args.from_raw:
        raise ValueError(f"--run {args.run} picks a run of a raw file: pass --from-raw RAW.json")
    if args.in_pass_rounds is not None and args.in_pass_rounds < 1:
        raise ValueError(f"--in-pass-rounds {args.in_pass_rounds} must be >= 1 (or left out: 5)")
    return {
        "device": args.device,
        "dtype": args.dtype,
        "kernel": args.kernel,
        "batch": args.batch,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "tokens": _ints(args.tokens, "--tokens"),
        "kernel_heads": _ints(args.kernel_heads, "--kernel-heads"),
        "sizes": _ints(args.sizes, "--sizes"),
        "reps": args.reps,
        "in_pass_rounds": args.in_pass_rounds,
        "threads": args.threads,
        "nodes": args.nodes,
        "ranks_per_node": None if args.launcher == "env" else args.ranks_per_node,
        # every rank on this host, sharing its cores (Note [Ranks sharing a host])
        "one_host": args.device == "cpu" and args.launcher != "env",
        "repeat": args.repeat,
        "timeout_s": args.timeout * args.repeat,
    }


def measure(args: argparse.Namespace, cfg: dict) -> dict | None:
    """Launch the ranks (or be one, ``--launcher env``); the raw samples on rank 0."""
    from megatron_charm.bench.attention import run_loopback, run_testbed
    from megatron_charm.sim.calibrate_worker import run

    if args.launcher == "env":
        return run(cfg)
    tmp = tempfile.mkdtemp(prefix="mc-calibrate-")
    cfg["raw_out"] = os.path.join(tmp, "raw.json")
    cfg_path = os.path.join(tmp, "config.json")
    if args.launcher == "testbed":
        run_testbed(cfg, cfg_path, args, module="megatron_charm.sim.calibrate")
    else:
        run_loopback(cfg, cfg_path, module="megatron_charm.sim.calibrate")
    with open(cfg["raw_out"]) as f:
        return json.load(f)


#: What each run of ``calibrate --repeat`` predicts to compare the runs (Note [Repeated
#: calibrations]).
SPREAD_METHODS = ("ring", "charm")


def prediction_spread(
    profiles: list[Profile], reference: Profile, raw: dict
) -> tuple[float, list[dict[str, float]]]:
    """How far ``profiles`` (one per run of ``calibrate --repeat``) disagree with ``reference``
    (the profile written): each predicts ring's and charm's forward and backward, causal, at
    ``reference``'s layout with the batch, heads, head dim and tokens per rank of ``raw``'s
    largest block; the largest relative difference from ``reference``'s, and each run's
    predicted seconds (``"ring fwd"``, ...)."""
    m, p = parse_gpus(reference.gpus)
    block = max(raw["kernel"], key=lambda k: (k["tokens"], k["heads"]))
    problem = Problem(
        block["batch"], m * p * block["tokens"], block["heads"], block["head_dim"], causal=True
    )

    def times(prof: Profile) -> dict[str, float]:
        pred = predict(prof.topology(m, p), problem, prof.compute_model(), SPREAD_METHODS)
        return {
            f"{name} {tag}": getattr(mp, pass_).makespan
            for name, mp in pred.methods.items()
            for tag, pass_ in (("fwd", "forward"), ("bwd", "backward"))
        }

    ref = times(reference)
    each = [times(prof) for prof in profiles]
    spread = max(abs(t[k] / v - 1.0) for t in each for k, v in ref.items() if v > 0)
    return spread, each


def combine_runs(raw: dict, combine: str, fabric: str) -> tuple[Profile, dict]:
    """The profile of ``raw`` (rank 0's samples, later runs under ``"repeats"``) and the samples
    it was fitted on: one run fitted as it is; several combined by ``combine`` (Note [Repeated
    calibrations]), their spread in ``fit_error["repeat"]``, a summary of each run in
    ``provenance["repeats"]``."""
    runs = split_runs(raw, labels=False)
    if len(runs) == 1:
        return fit_profile(runs[0], fabric=fabric), runs[0]
    if combine not in COMBINE:
        raise ValueError(f"--combine {combine!r} is not one of {', '.join(COMBINE)}")
    fits = [fit_profile(r, fabric=fabric) for r in runs]
    if combine == "pool":
        keep, samples = None, pool_runs(runs)
        profile = fit_profile(samples, fabric=fabric)
    else:
        keep = pick_repeat(runs)
        samples, profile = runs[keep], fits[keep]
    spread, times = prediction_spread(fits, profile, raw)
    summary = repeat_summary(runs, keep)
    for row, t in zip(summary, times, strict=True):
        row["predicted_s"] = t
    # Note [A calibration's drift]: the machine moved as much as its least steady run saw
    drifts = [speed_drift(r) for r in runs]
    known = [d for d in drifts if d is not None]
    moved = {"drift": max(known)} if known else {}
    for row, d in zip(summary, drifts, strict=True):
        if d is not None:
            row["drift"] = d
    profile = replace(
        profile,
        fit_error={**profile.fit_error, **moved, "repeat": spread},
        provenance={**profile.provenance, "repeats": summary, "combine": combine},
    )
    return profile, samples


def read_raw(path: str, run: int | None = None) -> dict:
    """The raw samples an earlier ``calibrate --raw`` wrote to ``path``; with ``run`` (1-based)
    that run of a ``--repeat`` calibration alone, with the file's labels."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"--from-raw {path}: cannot read it ({err}); pass the file an earlier calibrate "
            "wrote with --raw"
        ) from err
    if run is None:
        return raw
    runs = split_runs(raw)
    if not 1 <= run <= len(runs):
        raise ValueError(f"--run {run}: {path} holds {len(runs)} run(s); pass 1..{len(runs)}")
    return runs[run - 1]


def describe(profile: Profile) -> str:
    c = profile.compute
    err = ", ".join(f"{k} {v:.0%}" for k, v in profile.fit_error.items())
    links = profile.nics_per_node or "one per rank"
    return "\n".join(
        [
            f"profile: {profile.name}",
            f"  intra {profile.intra_bw:.4g} GB/s + {profile.intra_lat * 1e6:.0f} us; cross "
            f"{profile.cross_bw:.4g} GB/s + {profile.cross_lat * 1e6:.0f} us; cross links per "
            f"node: {links}"
            + ("; cross fixed cost on the link" if profile.cross_lat_on_link else "")
            + (
                f"; PCIe domain {profile.pcie_domain:.4g} GB/s per node and direction"
                if profile.pcie_domain
                else ""
            ),
            f"  kernel forward {c['fwd_flops_per_s'] / 1e12:.4g} TFLOP/s + "
            f"{c['fwd_overhead'] * 1e6:.0f} us per block + "
            f"{c.get('fwd_per_element', 0) * 1e9:.3g} ns per element, backward "
            f"{c['bwd_flops_per_s'] / 1e12:.4g} TFLOP/s + {c['bwd_overhead'] * 1e6:.0f} us + "
            f"{c.get('bwd_per_element', 0) * 1e9:.3g} ns; merges {c['mem_bw']:.3g} GB/s",
            f"  blocks under communication: forward x{c['fwd_slowdown']:.2f}, backward "
            f"x{c['bwd_slowdown']:.2f}; in a pass over alone: forward "
            f"x{c.get('fwd_in_pass', 1.0):.2f}, backward x{c.get('bwd_in_pass', 1.0):.2f}",
            f"  host work (CPU hosts): {c.get('host_call_s', 0) * 1e3:.3g} ms per pass + "
            f"{c.get('host_post_s', 0) * 1e3:.3g} ms per exchange + "
            f"{c.get('host_byte_s', 0) * 1e9:.3g} ns per byte sent + "
            f"{c.get('host_element_fwd_s', 0) * 1e9:.3g} / "
            f"{c.get('host_element_bwd_s', 0) * 1e9:.3g} ns per query element (forward / "
            "backward); transport threads "
            f"{c.get('transport_post_s', 0) * 1e3:.3g} ms per exchange + "
            f"{c.get('transport_byte_s', 0) * 1e9:.3g} ns per byte, x"
            f"{c.get('transport_in_pass', 1.0):.2f} in a pass",
            f"  largest fit residuals: {err}",
            *stability_warnings(profile),
        ]
    )


def stability_warnings(profile: Profile) -> list[str]:
    """A warning line for each sign that the machine's speed moved while it was calibrated
    (:func:`~megatron_charm.sim.repeats.unsteady`); none otherwise."""
    return [
        f"  warning: {why}; predictions from this profile can be off by as much; calibrate "
        "again when it is quiet"
        for why in unsteady(profile.fit_error)
    ]


def _error(err: ValueError) -> int:
    print(f"megatron-charm-sim calibrate: error: {err}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:  # internal: one rank launched by this command
        from megatron_charm.sim.calibrate_worker import run

        with open(argv[1]) as f:
            cfg = json.load(f)
        raw = run(cfg)
        if raw is not None:
            with open(cfg["raw_out"], "w") as f:
                json.dump(raw, f)
        import torch.distributed as dist

        from megatron_charm.launch.call import leave_rank

        dist.barrier()
        dist.destroy_process_group()
        leave_rank(0)  # Note [Leaving a rank process]
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        return _error(err)
    command = "megatron-charm-sim calibrate " + shlex.join(argv)
    if args.from_raw:
        try:
            raw = read_raw(args.from_raw, args.run)
        except ValueError as err:
            return _error(err)
        provenance = {"refit": command, "command": raw.get("command", "not recorded")}
    else:
        started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        raw = measure(args, cfg)
        if raw is None:  # not rank 0 under --launcher env
            return 0
        if raw.get("device") == "cuda":
            import torch  # noqa: F401  (host() names the GPU where torch is loaded)
        raw.update(date=started, host=host(), command=command, launcher=args.launcher)
        if args.raw:
            with open(args.raw, "w") as f:
                json.dump(raw, f, indent=1)
        provenance = {"command": command}
    try:
        profile, fitted = combine_runs(raw, args.combine, args.fabric)
    except ValueError as err:  # runs that measured different things, from a raw file
        return _error(err)
    samples = (
        "kernel",
        "merge",
        "p2p",
        "concurrent_cross",
        "concurrent_intra",
        "kernel_under_traffic",
        "kernel_again",
        "one_host",
        "host_cores",
        "threads",
        "host_work",
        "host_cpu",
        "blocks_in_passes",
    )
    profile = replace(
        profile,
        provenance={
            **profile.provenance,
            **provenance,
            "date": raw.get("date", "not recorded"),
            "launcher": raw.get("launcher", "not recorded"),
            "host": raw.get("host", "not recorded"),
            "samples": {k: fitted.get(k) for k in samples},
        },
    )
    profile.save(args.out)
    print(describe(profile))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
