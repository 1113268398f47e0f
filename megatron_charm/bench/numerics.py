"""``megatron-charm-bench numerics``: the paper's Table 8 on CPU ranks.

For each of ``--runs`` random problems (q, k, v and the output gradient from a standard normal,
rounded to the benchmark dtype), CHARM+ and ring attention run forward and backward on ``m x p``
gloo ranks (local loopback; errors do not depend on link speed). Rank 0 reassembles the global
``out``, ``lse``, ``dq``, ``dk``, ``dv`` and compares them with float64 attention on the same
rounded inputs: per run the mean and the max of the absolute difference, then the average of each
over the runs (the paper's reduction). A third column, ``single``, is PyTorch's flash-attention
kernel on the whole sequence in one process: the error floor of the dtype.

A method may carry plan options, ``NAME:key=value[:key=value]`` (``charm:cross_return=input``),
so that two settings of one method are compared in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

from megatron_charm.launch import RankInfo, run_function
from megatron_charm.plan import PlanOptions

QUANTITIES = ("out", "lse", "dq", "dk", "dv")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048, help="global sequence length")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument(
        "--methods",
        default="charm,ring",
        help="comma-separated; NAME:key=value[:key=value] sets plan options of one entry",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--md", dest="md_out", default=None)


def _problem(args, run: int):
    """Global ``q, k, v, dout`` as ``[b, seq, h, d]`` in the benchmark dtype."""
    gen = torch.Generator().manual_seed(args["seed"] + run)
    b, s, h, d = args["batch"], args["seq"], args["heads"], args["head_dim"]
    shapes = [(b, s, h, d), *[(b, s, args["kv_heads"], d)] * 2, (b, s, h, d)]
    return [torch.randn(shape, generator=gen).to(DTYPES[args["dtype"]]) for shape in shapes]


def method_options(spec: str) -> PlanOptions:
    """``charm:cross_return=input:window=1`` -> the plan options it names."""
    name, *pairs = spec.split(":")
    changes: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in PlanOptions.__dataclass_fields__ or key == "method":
            raise ValueError(
                f"--methods entry {spec!r}: {pair!r} is not key=value with a PlanOptions field "
                f"({', '.join(f for f in PlanOptions.__dataclass_fields__ if f != 'method')})"
            )
        default = getattr(PlanOptions(), key)
        if isinstance(default, bool):
            changes[key] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, int):
            changes[key] = int(value)
        else:
            changes[key] = value
    return PlanOptions(method=name, **changes)


def _errors(got: dict, ref: dict) -> dict[str, tuple[float, float]]:
    out = {}
    for key in QUANTITIES:
        diff = (got[key].double() - ref[key].double()).abs()
        out[key] = (diff.mean().item(), diff.max().item())
    return out


def _reference(q, k, v, dout, scale: float) -> dict:
    """float64 attention over the whole sequence: tensors ``[b, s, h, d]``, lse ``[b, h, s]``."""
    from megatron_charm.kernels.backends import _KERNELS

    sb = [t.double().transpose(0, 1) for t in (q, k, v, dout)]
    math = _KERNELS["math"]
    out, lse = math.forward(*sb[:3], True, scale)
    dq, dk, dv = math.backward(sb[3], *sb[:3], out, lse, True, scale)
    res = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    res = {k2: t.transpose(0, 1) for k2, t in res.items()}
    res["lse"] = lse.permute(1, 2, 0)
    return res


def _single(q, k, v, dout, scale: float) -> dict:
    """The torch flash-attention kernel on the whole sequence, in the input dtype."""
    from megatron_charm.kernels.backends import _KERNELS

    sb = [t.transpose(0, 1).contiguous() for t in (q, k, v, dout)]
    kern = _KERNELS["torch"]
    out, lse = kern.forward(*sb[:3], True, scale)
    dq, dk, dv = kern.backward(sb[3], *sb[:3], out, lse, True, scale)
    res = {k2: t.transpose(0, 1) for k2, t in {"out": out, "dq": dq, "dk": dk, "dv": dv}.items()}
    res["lse"] = lse.permute(1, 2, 0)
    return res


def _rank_main(info: RankInfo, args: dict, result_path: str) -> None:
    import megatron_charm as mc
    from megatron_charm.plan import zigzag_positions

    torch.set_num_threads(1)
    world = args["nodes"] * args["ranks_per_node"]
    cp_rank = info.global_rank
    info.init_process_group("gloo")
    topo = mc.CPTopology.build(None, ranks_per_node=args["ranks_per_node"])
    scale = args["head_dim"] ** -0.5
    idx = torch.tensor(zigzag_positions(cp_rank, world, args["seq"]))
    methods = args["methods"]
    sums = {m: {k: [0.0, 0.0] for k in QUANTITIES} for m in [*methods, "single"]}
    for run in range(args["runs"]):
        q, k, v, dout = _problem(args, run)
        local = {}
        for method in methods:
            lq, lk, lv = (t[:, idx].clone().requires_grad_() for t in (q, k, v))
            out, lse = mc.cp_attention(
                lq, lk, lv, topo, options=method_options(method), causal=True, return_lse=True
            )
            out.backward(dout[:, idx])
            local[method] = (out.detach(), lse, lq.grad, lk.grad, lv.grad)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (idx, local))
        if cp_rank != 0:
            continue
        ref = _reference(q, k, v, dout, scale)
        results = {"single": _single(q, k, v, dout, scale)}
        for method in methods:
            full = {key: torch.empty_like(ref[key], dtype=torch.float64) for key in QUANTITIES}
            for ridx, loc in gathered:
                o, lse, dq, dk, dv = loc[method]
                full["out"][:, ridx] = o.double()
                full["lse"][:, :, ridx] = lse.double()
                full["dq"][:, ridx], full["dk"][:, ridx], full["dv"][:, ridx] = (
                    dq.double(),
                    dk.double(),
                    dv.double(),
                )
            results[method] = full
        for name, got in results.items():
            for key, (mean, mx) in _errors(got, ref).items():
                sums[name][key][0] += mean
                sums[name][key][1] += mx
    if cp_rank == 0:
        n = args["runs"]
        table = {m: {k: {"mean": s[0] / n, "max": s[1] / n} for k, s in v.items()}
                 for m, v in sums.items()}  # fmt: skip
        with open(result_path, "w") as f:
            json.dump(table, f)
    dist.destroy_process_group()


def markdown(table: dict, args: dict) -> str:
    """Table 8's layout: per quantity, each method's max and mean (averaged over the runs)."""
    names = [*args["methods"], "single"]
    label = {"charm": "CHARM+", "ring": "Ring", "single": "single process"}
    head = "| Diff | " + " | ".join(
        f"{label.get(n, n)} (Max) | {label.get(n, n)} (Mean)" for n in names
    )
    lines = [head + " |", "|---" * (1 + 2 * len(names)) + "|"]
    for key in QUANTITIES:
        cells = [key]
        for n in names:
            cells += [f"{table[n][key]['max']:.5e}", f"{table[n][key]['mean']:.5e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_numerics(ns: argparse.Namespace) -> dict:
    """Run the numerics table as configured; returns ``{method: {quantity: {mean, max}}}``."""
    methods = [m for m in ns.methods.split(",") if m]
    for spec in methods:
        method_options(spec)  # a bad entry fails here, before any rank starts
    kv_heads = ns.kv_heads or ns.heads
    if ns.heads % kv_heads:
        raise ValueError(f"--heads {ns.heads} must be a multiple of --kv-heads {kv_heads}")
    world = ns.nodes * ns.ranks_per_node
    if ns.seq % (2 * world):
        raise ValueError(f"--seq {ns.seq} must be divisible by 2 * ranks = {2 * world} (zigzag)")
    if ns.runs < 1:
        raise ValueError(f"--runs {ns.runs} must be >= 1")
    args = {
        "runs": ns.runs, "nodes": ns.nodes, "ranks_per_node": ns.ranks_per_node,
        "batch": ns.batch, "seq": ns.seq, "heads": ns.heads, "kv_heads": kv_heads,
        "head_dim": ns.head_dim,
        "dtype": ns.dtype, "methods": methods, "seed": ns.seed,
    }  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="mc-numerics-")
    result = os.path.join(tmp, "result.json")
    run_function(_rank_main, args, result, nproc=world)
    with open(result) as f:
        table = json.load(f)
    md = markdown(table, args)
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({"config": args, "table": table}, f, indent=1)
    if ns.md_out:
        with open(ns.md_out, "w") as f:
            f.write(md)
    print(md)
    return table
