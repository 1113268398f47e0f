"""``megatron-charm-sim``: predict CP attention times per method, or ``advise`` a ``cp_comm_type``.

Examples::

    megatron-charm-sim --gpus 2x8 --intra-bw 365 --cross-bw 42.5 --tflops 989 \\
        --batch 16 --seq 26880 --heads 12 --head-dim 192
    megatron-charm-sim advise --preset H100 --gpus 16x8 --batch 1 --seq 131072 --heads 16 \\
        --head-dim 128 --causal
    megatron-charm-sim --preset H100 --gpus 2x8 --batch 16 --seq 26880 --heads 12 \\
        --head-dim 192 --replay paper        # the paper's ring and CHARM+, next to its Table 5
    megatron-charm-sim advise --preset H100 --gpus-per-node 8 --megatron "--num-attention-heads \\
        32 --hidden-size 4096 --seq-length 131072 --tensor-model-parallel-size 2 \\
        --context-parallel-size 16 --bf16"    # a Megatron-LM run's own arguments
    megatron-charm-sim calibrate --launcher loopback --out mine.json
    megatron-charm-sim advise --profile mine.json --gpus 4x2 --seq 65536 --heads 8 --head-dim 64
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace

from megatron_charm.plan import METHODS, PlanOptions
from megatron_charm.plan.options import BASELINES, add_plan_arguments, plan_values_from_args
from megatron_charm.sim.compute import ComputeModel, Enqueue, FlopsCompute, describe_compute
from megatron_charm.sim.megatron_args import against_current, apply_problem_source
from megatron_charm.sim.node_groups import per_rank_heads, shared_by
from megatron_charm.sim.predict import (
    SIMPLICITY,
    Prediction,
    Problem,
    advise,
    ccr_ratio,
    combined_error,
    describe_links,
    error_list,
    margin_range,
    margin_replay_error,
    nominal_ccr_parts,
    one_node_note,
    predict,
    replay_error,
    runner_up,
    speedup_range,
)
from megatron_charm.sim.profile import Profile, load_profile
from megatron_charm.sim.programs import MODES
from megatron_charm.sim.sensitivity import (
    assumes_preset_costs,
    enqueue_note,
    fits_note,
    intra_lat_note,
)
from megatron_charm.sim.topology import (
    CROSS_LINKS,
    FABRICS,
    GPU_ENQUEUE,
    PRESETS,
    Topology,
    parse_gpus,
)

#: The plan options the simulator takes as flags.
SIM_PLAN_OPTIONS = ("window", "cross_level", "intra_level", "memory_budget")

#: What ``--replay`` replays: our schedules, or ring, charm and rm+ as the paper ran them.
REPLAYS = ("ours", "paper")
#: Methods ``--replay paper`` can replay: the paper's Ring-Zigzag (``ring``) and Ring-Attention
#: (``ring-contig``, the contiguous layout: under causal masking its last rank computes every
#: block), CHARM+ and RM+; TASP's flat form is the planner's own ``tasp``.
PAPER_METHODS = ("ring", "ring-contig", "charm", "rm+", "tasp")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="megatron-charm-sim",
        description="Replay the CP attention schedules of every method on a cluster model. "
        "Start the arguments with 'advise' to get a recommended --cp-comm-type.",
    )
    hw = ap.add_argument_group("cluster (a --preset or --profile fills these; flags override it)")
    hw.add_argument("--preset", choices=sorted(PRESETS), help="hardware of the paper's Table 2")
    hw.add_argument(
        "--profile", help="a profile JSON from 'megatron-charm-sim calibrate' (or a preset name)"
    )
    hw.add_argument("--gpus", help="NODESxGPUS_PER_NODE of the CP group, e.g. 2x8")
    hw.add_argument("--intra-bw", type=float, help="intra-node P2P bandwidth, GB/s")
    hw.add_argument("--cross-bw", type=float, help="cross-node P2P bandwidth, GB/s")
    hw.add_argument("--tflops", type=float, help="peak TFLOPS per GPU")
    hw.add_argument(
        "--efficiency", type=float, help="achieved fraction of peak in attention (default 0.5)"
    )
    hw.add_argument(
        "--sms",
        type=int,
        help="streaming multiprocessors per GPU: blocks run as tiles in waves over them "
        "(presets: their GPU's; flags alone: 0, blocks at their FLOPs)",
    )
    hw.add_argument("--fabric", choices=FABRICS, help="intra-node fabric (default nvlink)")
    hw.add_argument(
        "--pcie-domain-bw",
        type=float,
        help="GB/s that all PCIe transfers of one node share per direction, with --fabric pcie "
        "(preset L20: 24; default 0: only each GPU's own link is shared)",
    )
    hw.add_argument("--cross-links", choices=CROSS_LINKS, help="cross links (default rails)")
    hw.add_argument(
        "--nics-per-node", type=int, help="cross links per node (overrides --cross-links)"
    )
    hw.add_argument(
        "--groups-per-node",
        type=int,
        help="CP groups whose ranks share each node, whose transfers meet on every link that is "
        "not a GPU's own (Note [Groups sharing a node]): GPUs per node / CP ranks per node "
        "(default: --tp)",
    )
    hw.add_argument("--intra-lat-us", type=float, help="intra-node latency, us (default 5)")
    hw.add_argument("--cross-lat-us", type=float, help="cross-node latency, us (default 10)")
    hw.add_argument("--mem-bw", type=float, help="GPU memory bandwidth for merges, GB/s")
    hw.add_argument(
        "--enqueue-us",
        type=float,
        help="host time to enqueue each kernel call, merge and exchange, us (presets: "
        f"{GPU_ENQUEUE.kernel * 1e6:g}; flags alone: 0); the device waits for it on small problems",
    )
    pb = ap.add_argument_group("problem")
    pb.add_argument(
        "--megatron",
        metavar="ARGS",
        help="the Megatron-LM arguments of the run, quoted as one string: the heads, kv heads, "
        "head dim, sequence, micro-batch, dtype, TP and CP sizes come from them, and with "
        "--gpus-per-node the CP group's nodes x ranks and the groups per node "
        "(megatron_charm/sim/megatron_args.py); the problem flags below are then not given",
    )
    pb.add_argument(
        "--gpus-per-node", type=int, help="with --megatron: GPUs per node of the cluster"
    )
    pb.add_argument("--batch", type=int, help="micro-batch size (default 1)")
    pb.add_argument("--seq", type=int, help="global sequence length (required)")
    pb.add_argument("--heads", type=int, help="query heads (required)")
    pb.add_argument("--kv-heads", type=int, help="key/value heads (GQA; default --heads)")
    pb.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel size: each CP rank holds heads / TP and kv heads / TP, and the TP "
        "ranks' CP groups share the nodes (default 1)",
    )
    pb.add_argument("--head-dim", type=int, help="head dimension (required)")
    pb.add_argument("--causal", action="store_true", help="causal attention (zigzag layout)")
    pb.add_argument("--dtype-bytes", type=int, help="bytes per q/k/v element (default 2)")
    sim = ap.add_argument_group("simulation")
    sim.add_argument(
        "--methods",
        help="comma-separated methods (default: every method that can split the problem; a2a "
        "needs heads and kv heads divisible by the GPU count)",
    )
    sim.add_argument("--mode", choices=MODES, default="auto", help="replay all ranks or one node")
    sim.add_argument(
        "--replay",
        choices=REPLAYS,
        default="ours",
        help="ours: the schedules this package runs (default); paper: ring, charm and rm+ as "
        "the paper ran them (its ring forward, zigzag or ring-contig, without overlap, its "
        "CHARM+ Algorithm 2; Note "
        "[The paper's baselines]), to compare with its tables (default methods: ring, charm)",
    )
    add_plan_arguments(sim, keys=SIM_PLAN_OPTIONS)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return ap


def groups_per_node(args: argparse.Namespace) -> int:
    """CP groups sharing each node: ``--groups-per-node``, else the TP size (Note [Groups
    sharing a node])."""
    return args.groups_per_node if args.groups_per_node is not None else args.tp


def sharing_line(args: argparse.Namespace, problem: Problem) -> str | None:
    """What ``--tp`` and ``--groups-per-node`` changed, for the output (``problem``: per CP
    rank, as :func:`_resolve` built it); ``None`` when neither did."""
    groups = groups_per_node(args)
    if args.tp == 1 and groups == 1:
        return None
    return (
        f"tensor parallel {args.tp}: each CP rank holds {problem.heads} of {args.heads} query "
        f"heads and {problem.kv_heads} of {args.kv_heads} kv heads; {groups} CP group(s) per "
        "node share its links: cross links that are not one per GPU, and a PCIe root complex, at "
        f"1/{groups} of their rate (Note [Groups sharing a node])"
    )


def _resolve(
    args: argparse.Namespace,
) -> tuple[Topology, Problem, ComputeModel, list[str] | None, Profile | None]:
    if args.preset and args.profile:
        raise ValueError("--preset and --profile both describe the cluster; pass one of them")
    apply_problem_source(args)
    heads, kv_heads = per_rank_heads(args.heads, args.kv_heads, args.tp)
    profile = load_profile(args.profile or args.preset) if (args.profile or args.preset) else None
    hw = PRESETS[args.preset] if args.preset else None

    def pick(value, attr: str, default=None):
        if value is not None:
            return value
        if profile is not None and hasattr(profile, attr):
            return getattr(profile, attr)
        if hw is not None and hasattr(hw, attr):
            return getattr(hw, attr)
        if default is None:
            flag = "--" + attr.replace("_", "-")
            raise ValueError(
                f"{flag} is missing: without --preset or --profile the cluster must be given in "
                f"full; pass {flag}, --profile PROFILE.json or --preset "
                f"{{{','.join(sorted(PRESETS))}}}"
            )
        return default

    m, p = parse_gpus(pick(args.gpus, "gpus"))
    base = profile.topology(m, p) if profile is not None else None
    # Flags override the profile's topology; every field no flag names keeps the profile's value
    # (a gloo calibration's exchange order, its latencies, any field added later).
    given: dict = {
        "intra_bw": pick(args.intra_bw, "intra_bw"),
        "cross_bw": pick(args.cross_bw, "cross_bw"),
        "fabric": pick(args.fabric, "fabric", "nvlink"),
    }
    if base is None or args.cross_links is not None or args.nics_per_node is not None:
        given["cross_links"] = args.cross_links or (hw.cross_links if hw else "rails")
        given["nics_per_node"] = (
            args.nics_per_node
            if args.nics_per_node is not None
            else (hw.nics_per_node if hw and args.cross_links is None else 0)
        )
    if args.pcie_domain_bw is not None:
        given["pcie_domain"] = args.pcie_domain_bw
    if args.intra_lat_us is not None:
        given["intra_lat"] = args.intra_lat_us * 1e-6
    if args.cross_lat_us is not None:
        given["cross_lat"] = args.cross_lat_us * 1e-6
    topo = replace(base, **given) if base is not None else Topology(m, p, **given)
    topo = shared_by(topo, groups_per_node(args))
    compute: ComputeModel
    if profile is not None and args.tflops is None and args.efficiency is None:
        compute = profile.compute_model()
        if args.mem_bw is not None:
            compute = replace(compute, mem_bw=args.mem_bw)
        if args.sms is not None:
            if not isinstance(compute, FlopsCompute):
                raise ValueError(
                    "--sms applies to FLOPs-based compute (a preset, or --tflops); this profile "
                    "measured its kernels; drop --sms"
                )
            compute = replace(compute, sms=args.sms)
    else:
        compute = FlopsCompute(
            pick(args.tflops, "tflops"),
            pick(args.efficiency, "efficiency", 0.5),
            mem_bw=pick(args.mem_bw, "mem_bw", 2000.0),
            enqueue=profile.compute_model().enqueue_cost() if profile is not None else None,
            sms=pick(args.sms, "sms", 0),
        )
    if args.enqueue_us is not None:
        e = args.enqueue_us * 1e-6
        if compute.host_slots() > 0:
            raise ValueError(
                "--enqueue-us is for GPU clusters; this profile has every rank on one CPU "
                "host, whose host work it measured; drop --enqueue-us"
            )
        compute = replace(compute, enqueue=Enqueue.per_operation(e))
    problem = Problem(
        args.batch, args.seq, heads, args.head_dim, kv_heads, args.causal, args.dtype_bytes
    )
    if args.methods is None:
        return topo, problem, compute, None, profile  # every method that fits (predict decides)
    methods = [x.strip() for x in args.methods.split(",") if x.strip()]
    bad = [x for x in methods if x not in METHODS]
    if bad or not methods:
        raise ValueError(
            f"--methods {args.methods!r}: {bad or 'empty'} not in {', '.join(METHODS)}; "
            "pass a comma-separated subset"
        )
    if "ring" not in methods:
        methods.insert(0, "ring")  # speedups are relative to ring
    return topo, problem, compute, methods, profile


def hardware_error(profile: Profile | None) -> tuple[str, float] | None:
    """Where the hardware numbers come from and their known relative error per time: a
    measured profile's worst fit of its own samples (Note [Fitting a profile]), a preset's worst
    miss of the paper's rows (``Hardware.paper_error``); ``None`` for numbers nobody measured
    (the flags, or a profile that is neither)."""
    if profile is None or not (profile.measured or profile.preset_error is not None):
        return None
    if profile.measured:
        err = profile.known_error or 0.0
        source = f"profile {profile.name!r}, whose fits miss their own samples by up to {err:.0%}"
        return source, err
    err = profile.preset_error or 0.0
    return (
        f"{profile.name}, whose {profile.preset} rows of the paper's Tables 4 and 5 it misses by "
        f"up to +-{err:.0%}",
        err,
    )


def uncertainty(pred: Prediction, choice: str, profile: Profile | None) -> str:
    """Where the hardware numbers come from (``profile``: the --profile or --preset in use), and
    ``choice``'s margin over the next method as a range from the model's known error
    (:func:`hardware_error`)."""
    known = hardware_error(profile)
    if known is None:
        given = "the flags given" if profile is None else f"profile {profile.name!r}"
        return (
            f"hardware numbers: {given}, not measured here; run `megatron-charm-sim "
            "calibrate` on the cluster and pass --profile for predictions you can check"
        )
    source, err = known
    nxt = runner_up(pred, choice)
    margin = nxt.total / pred.methods[choice].total if nxt else 1.0
    # a one-node replay's known error adds to the hardware's (Note [Node symmetry])
    approximate = margin_replay_error(pred, choice)
    that = "that error"
    if approximate:
        source += f"; one-node replays off by {error_list(approximate)}"
        err = combined_error(err, max(approximate.values()))
        that = "both errors"
    lo, hi = margin_range(margin, err)
    return (
        f"uncertainty: {source}; {choice}'s margin over the next method {margin:.2f}x, "
        f"{lo:.2f}x-{hi:.2f}x within {that}"
    )


def _ms(parts: tuple[float, float]) -> str:
    return f"{parts[0] * 1e3:.3g} / {parts[1] * 1e3:.3g} ms"


def _nominal_line(pred: Prediction) -> str:
    assert pred.ccr_nominal is not None
    fwd, bwd = pred.ccr_nominal
    return (
        f"CCR at Table 2's rates, as the paper counts it (bytes over its measured bandwidth): "
        f"forward {ccr_ratio(fwd):.3f}, backward {ccr_ratio(bwd):.3f} (T_comm "
        f"{fwd[1] * 1e3:.3g} ms forward, {bwd[1] * 1e3:.3g} ms backward)"
    )


def format_table(pred: Prediction, error: float | None = None) -> str:
    """The prediction as a table; ``error``, if known, the hardware numbers' relative error per
    time (:func:`hardware_error`), which puts each speedup's range next to it
    (:func:`~megatron_charm.sim.predict.speedup_range`)."""
    t, pr = pred.topo, pred.problem
    ranged = error is not None
    lines = [
        f"{t.num_nodes}x{t.ranks_per_node} GPUs, intra {t.intra_bw:g} GB/s ({t.fabric}), "
        f"cross {t.cross_bw:g} GB/s ({t.nics} per node); batch {pr.batch}, seq {pr.seq} "
        f"(local {pred.shape.s_local}), heads {pr.heads}x{pr.head_dim}"
        f"{', causal' if pr.causal else ''}",
        f"CCR forward {pred.ccr_forward:.3f}, backward {pred.ccr_backward:.3f} (ring's blocks "
        f"over its transfers, one after the other: T_comp / T_comm {_ms(pred.ccr_seconds[0])} "
        f"forward, {_ms(pred.ccr_seconds[1])} backward)",
        *([_nominal_line(pred)] if pred.ccr_nominal is not None else []),
        f"links: {describe_links(t)}",
        f"compute: {describe_compute(pred.compute)}" if pred.compute is not None else "",
        f"unit: {pred.UNIT}",
        "",
    ]
    span = f" {'range':>11}" if ranged else ""
    lines.append(
        f"{'method':<11} {'fwd ms':>9} {'speedup':>8}{span} {'exposed':>9} "
        f"{'bwd ms':>9} {'speedup':>8}{span} {'exposed':>9} {'cross GB/node':>14}"
    )
    order = ["ring", "ring-contig", "tasp", "all_gather", "a2a", "a2a+p2p", "a2a+charm"]
    order += ["merge", "rm+", "charm"]
    order = [m for m in order if m in pred.methods]

    def speedup(name: str, backward: bool) -> str:
        cell = f"{pred.speedup(name, backward):7.2f}x"
        if not ranged:
            return cell
        if name == "ring":
            return f"{cell} {'':>11}"
        lo, hi = speedup_range(pred, name, backward, error)
        return f"{cell} {f'{lo:.2f}-{hi:.2f}x':>11}"

    for name in order:
        mp = pred.methods[name]
        f, b = mp.forward, mp.backward
        nodes = len(f.ranks) / t.ranks_per_node  # simulated nodes (one in symmetric mode)
        cross = (f.link_bytes().get("cross", 0) + b.link_bytes().get("cross", 0)) / nodes
        lines.append(
            f"{name:<11} {f.makespan * 1e3:9.3f} {speedup(name, False)} "
            f"{f.exposed_mean * 1e3:9.3f} {b.makespan * 1e3:9.3f} "
            f"{speedup(name, True)} {b.exposed_mean * 1e3:9.3f} {cross / 1e9:14.3f}"
        )
    if ranged:
        lines.append(
            f"range: the speedup when each of its two times may be off by the hardware "
            f"numbers' known error ({error:.0%}), and by a one-node replay's where one was used"
        )
    if any(not mp.exact for mp in pred.methods.values()):
        approximate = replay_error(pred, pred.methods)
        said = f"; {one_node_note(approximate)}" if approximate else ""
        lines.append(
            "note: causal plans on many nodes are replayed for one node with node symmetry; "
            f"per-node traffic is approximated (see docs/simulator.md){said}"
        )
    return "\n".join(lines)


def _links_overridden(args: argparse.Namespace) -> bool:
    return any(
        x is not None
        for x in (
            args.intra_bw,
            args.cross_bw,
            args.cross_links,
            args.nics_per_node,
            args.pcie_domain_bw,
        )
    )


def _table2_ccr(args: argparse.Namespace, pred: Prediction) -> None:
    """Set ``pred.ccr_nominal`` where a preset's transfers run below Table 2's rates in the
    paper's schedules (H20, H100) and no flag overrides its links."""
    hw = PRESETS[args.preset] if args.preset else None
    if hw is None or (hw.cross_rate == 1 and hw.intra_rate == 1) or _links_overridden(args):
        return
    pred.ccr_nominal = nominal_ccr_parts(pred, hw.intra_bw, hw.cross_bw)


def _a2a_links(args: argparse.Namespace, topo: Topology) -> Topology | None:
    """The links a preset's all-to-all runs on (:meth:`Hardware.a2a_topology`), where the
    preset knows them and no flag overrides its links; ``None`` elsewhere."""
    if not args.preset or not PRESETS[args.preset].a2a_rate:
        return None
    if _links_overridden(args):
        return None
    # one NIC per GPU: not shared with the other CP groups on the node (Note [Groups sharing a
    # node]), so --tp and --groups-per-node leave these links as they are
    return PRESETS[args.preset].a2a_topology(topo.num_nodes, topo.ranks_per_node)


#: CP groups above this size get a line on stderr per replayed method: a full replay of 128
#: ranks takes 10-14 s a method (docs/simulator.md, "Speed and node symmetry").
PROGRESS_ABOVE_RANKS = 32


def _progress(topo: Topology, again: bool = False) -> Callable[[str, int, int], None] | None:
    """Where replays take seconds each, say which method runs (stderr: a JSON stdout stays
    clean); ``again``: a replay with one cost changed, to check the pick against it."""
    if topo.cp_size <= PROGRESS_ABOVE_RANKS:
        return None
    why = " again, with one cost changed (does the pick depend on it?)" if again else ""

    def say(method: str, index: int, count: int) -> None:
        print(
            f"megatron-charm-sim: replaying {method} ({index + 1} of {count}) on "
            f"{topo.num_nodes}x{topo.ranks_per_node} ranks{why}",
            file=sys.stderr,
            flush=True,
        )

    return say


def _paper_prediction(
    args: argparse.Namespace,
    command: str,
    topo: Topology,
    problem: Problem,
    compute: ComputeModel,
    methods: list[str] | None,
    a2a: Topology | None,
) -> Prediction:
    """``--replay paper``: the paper's ring, CHARM+ and RM+ (Note [The paper's baselines] in
    :mod:`megatron_charm.sim.baselines`), to set next to its tables."""
    from megatron_charm.sim.baselines import paper_predict

    if command == "advise":
        raise ValueError(
            "advise recommends one of this package's schedules; --replay paper replays the "
            "paper's own: drop --replay paper, or run the prediction without 'advise'"
        )
    values, defaults = plan_values_from_args(args, keys=SIM_PLAN_OPTIONS), PlanOptions()
    given = [k for k, v in values.items() if v != getattr(defaults, k)]
    if given or args.mode != "auto":
        flags = [f"--{k.replace('_', '-')}" for k in given] + (["--mode"] * (args.mode != "auto"))
        raise ValueError(
            f"{', '.join(flags)} set our schedules' options; --replay paper replays the paper's "
            "fixed ones: drop them, or --replay ours"
        )
    picked = methods or ["ring", "charm"]
    bad = [m for m in picked if m not in PAPER_METHODS]
    if bad:
        raise ValueError(
            f"--methods {','.join(bad)}: --replay paper replays {', '.join(PAPER_METHODS)}; pick "
            "among those, or --replay ours"
        )
    return paper_predict(topo, problem, compute, tuple(picked), a2a)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        from megatron_charm.sim.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    command = "predict"
    if argv and argv[0] in ("advise", "predict"):
        command = argv.pop(0)
    args = build_parser().parse_args(argv)
    tasp_note = None
    try:
        topo, problem, compute, methods, profile = _resolve(args)
        a2a = _a2a_links(args, topo)
        options = PlanOptions().replace(**plan_values_from_args(args, keys=SIM_PLAN_OPTIONS))

        def replay(
            model: ComputeModel, names: tuple[str, ...] | None, links: Topology = topo
        ) -> Prediction:
            all_to_all = a2a
            if a2a is not None and links is not topo:  # a replay at another intra-node cost
                all_to_all = replace(a2a, intra_lat=links.intra_lat)
            if args.replay == "paper":
                picked = None if names is None else list(names)
                return _paper_prediction(args, command, links, problem, model, picked, all_to_all)
            return predict(
                links,
                problem,
                model,
                names,
                args.mode,
                options,
                a2a_topo=all_to_all,
                # the sensitivity checks replay with one cost changed: a new model or links
                progress=_progress(links, again=model is not compute or links is not topo),
            )

        pred = replay(compute, None if methods is None else tuple(methods))
        _table2_ccr(args, pred)
        # Note [Enqueue sensitivity]: a preset's enqueue and intra-node costs are not this
        # cluster's, unless --enqueue-us / --intra-lat-us give the user's own
        preset = profile if assumes_preset_costs(profile) else None
        known = (preset.preset_error or 0.0) if preset is not None else 0.0
        adv = advise(pred) if command == "advise" else None
        compared = tuple(m for m in pred.methods if m not in BASELINES)
        lead = adv.method if adv is not None else min(compared, key=lambda m: pred.methods[m].total)
        candidates = SIMPLICITY if adv is not None else compared
        note: str | None = None
        links_note: str | None = None
        if preset is not None and args.enqueue_us is None:
            note = enqueue_note(pred, lead, compute, replay, candidates, known)
        if preset is not None and args.intra_lat_us is None:
            links_note = intra_lat_note(
                pred,
                lead,
                topo,
                lambda links, names: replay(compute, names, links),
                candidates,
                known,
            )
        fits: str | None = None
        if profile is not None and profile.measured and profile.fit_error:
            # Note [What a fit's error moves]
            fits = fits_note(pred, lead, compute, topo, replay, profile.fit_error, candidates)
        if a2a is not None and "tasp" in pred.methods:
            tasp_note = (
                f"tasp: its all-to-all steps on one NIC per GPU at {a2a.cross_bw:g} GB/s each, "
                "as the paper's TASP rows show (docs/simulator.md, all-to-all across nodes)"
            )
            if args.replay == "paper":
                tasp_note += (
                    "; its backward is our planner's, one return exchange a step and one merge "
                    "per peer and step: the paper's TASP has none (its footnote 4)"
                )
    except ValueError as err:
        print(f"megatron-charm-sim: error: {err}", file=sys.stderr)
        return 2
    shared = sharing_line(args, problem)
    source = args.megatron_line
    totals = {m: mp.total for m, mp in pred.methods.items()}
    current = against_current(args.megatron_types, totals, lead)
    if adv is not None:
        if source:
            adv.reasons.append(source)
        if current:
            adv.reasons.append(current)
        if shared:
            adv.reasons.append(shared)
        adv.reasons.append(uncertainty(pred, adv.method, profile))
        adv.reasons.extend(n for n in (fits, note, links_note) if n)
        if args.json:
            print(json.dumps({"cp_comm_type": adv.method, "reasons": adv.reasons}, indent=2))
        else:
            print(f"recommended: --cp-comm-type {adv.method}")
            for r in adv.reasons:
                print(f"  - {r}")
        return 0
    replayed = (
        "the paper's ring, CHARM+ and RM+ (Note [The paper's baselines]), not this package's"
        if args.replay == "paper"
        else "this package's schedules"
    )
    known = hardware_error(profile)
    error = known[1] if known is not None else None
    if args.json:
        data = pred.to_dict(error)
        data["uncertainty"] = uncertainty(pred, lead, profile)
        data["replay"] = {"schedules": args.replay, "what": replayed}
        if tasp_note:
            data["tasp_links"] = tasp_note
        if fits:
            data["fits_note"] = fits
        if note:
            data["enqueue_note"] = note
        if links_note:
            data["links_note"] = links_note
        data["node_groups"] = {"tp": args.tp, "groups_per_node": groups_per_node(args)}
        if shared:
            data["node_groups"]["note"] = shared
        if source:
            data["megatron"] = source
        if current:
            data["current_cp_comm_type"] = current
        print(json.dumps(data, indent=2, default=str))
    else:
        print(f"schedules: {replayed}")
        if source:
            print(source)
        print(format_table(pred, error))
        if shared:
            print(shared)
        if current:
            print(current)
        if tasp_note:
            print(tasp_note)
        print(uncertainty(pred, lead, profile))
        for n in (fits, note, links_note):
            if n:
                print(n)
    return 0
