"""Where a testbed pass's CPU goes: the kernel's calls, the rest of the calling thread, the
transport's threads; against what a profile's replay charges for each.

Each rank runs forward+backward passes of the real attention (one method, ``--iters`` timed
after two dropped), the block kernel's calls timed on the calling thread
(``calibrate_worker._counting``). Per pass and rank, the medians of: the process's CPU seconds
(all threads), the calling thread's, the kernel's, the wall time. With ``--profile``, the
replay's charges for the same pass (blocks alone and as scaled in a pass, the host work of the
calling thread, the transport's; summed over the ranks) sit next to them (Note [Blocks in a
pass] in megatron_charm/sim/in_pass.py). Needs the testbed (root, docs/testbed.md):

    python scripts/bench/blocks_in_pass.py --nodes 4 --ranks-per-node 2 --heads 8 --kv-heads 2 \\
        --profile docs/results/calibrate/profile-....json [--md FILE]

(about a minute)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

from megatron_charm.bench.report import emit
from megatron_charm.testbed.script import add_rank_arguments, run_script_ranks


def rank_main(cfg: dict, out_path: str) -> None:
    """One rank: the timed passes; rank 0 writes every rank's medians ``[process, thread,
    kernel, wall]`` (seconds)."""
    import torch
    import torch.distributed as dist

    from megatron_charm import cp_attention
    from megatron_charm.bench.worker import start_rank
    from megatron_charm.kernels.backends import select_kernel
    from megatron_charm.sim.calibrate_worker import _counting
    from megatron_charm.testbed.script import gather_to_file

    device, topo = start_rank({"threads": 1})
    spent = [0.0]
    kernel = _counting(select_kernel(device, torch.bfloat16, None), spent)
    gen = torch.Generator().manual_seed(topo.cp_rank)
    b, s, h, hkv, d = (cfg[k] for k in ("batch", "seq_local", "heads", "kv_heads", "head_dim"))
    q = torch.randn(b, s, h, d, generator=gen).to(torch.bfloat16).requires_grad_(True)
    k = torch.randn(b, s, hkv, d, generator=gen).to(torch.bfloat16).requires_grad_(True)
    v = torch.randn(b, s, hkv, d, generator=gen).to(torch.bfloat16).requires_grad_(True)
    dout = torch.ones(b, s, h, d, dtype=torch.bfloat16)
    recs = []
    for rep in range(cfg["iters"] + 2):
        dist.barrier()
        spent[0] = 0.0
        c0, h0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        out = cp_attention(q, k, v, topo, method=cfg["method"], causal=cfg["causal"], kernel=kernel)
        out.backward(dout)
        c1, h1, t1 = time.process_time(), time.thread_time(), time.perf_counter()
        if rep >= 2:
            recs.append((c1 - c0, h1 - h0, spent[0], t1 - t0))
    gather_to_file([statistics.median(x) for x in zip(*recs, strict=True)], out_path)


def measured(ranks: list[list[float]]) -> dict[str, float]:
    """Sums over the ranks of ``rank_main``'s medians: ``process``, ``kernel``, ``thread_rest``
    (the calling thread outside the kernel), ``transport`` (the process's other threads), and
    the slowest rank's ``wall``."""
    return {
        "process": sum(r[0] for r in ranks),
        "kernel": sum(r[2] for r in ranks),
        "thread_rest": sum(r[1] - r[2] for r in ranks),
        "transport": sum(r[0] - r[1] for r in ranks),
        "wall": max(r[3] for r in ranks),
    }


def charged(cfg: dict, profile: str) -> dict[str, float]:
    """What the replay of ``profile`` charges one forward+backward pass of ``cfg``'s problem,
    summed over the ranks: ``blocks_alone`` and ``blocks`` (scaled in a pass), ``host`` (the
    calling thread's host work) and ``transport``."""
    from megatron_charm.plan import PlanOptions
    from megatron_charm.plan.payloads import AttnShape
    from megatron_charm.plan.types import Compute, Exchange, Layout
    from megatron_charm.sim.engine import Engine
    from megatron_charm.sim.profile import load_profile
    from megatron_charm.sim.programs import programs

    prof = load_profile(profile)
    compute = prof.compute_model()
    m, p = cfg["nodes"], cfg["ranks_per_node"]
    shape = AttnShape(
        cfg["batch"], cfg["seq_local"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    )
    opts = PlanOptions(method=cfg["method"])
    progs = programs(opts, Layout(m, p), cfg["causal"], "full", shape)
    got = dict.fromkeys(("blocks_alone", "blocks", "host", "transport"), 0.0)
    for backward in (False, True):
        eng = Engine(progs, prof.topology(m, p), shape, compute, backward)
        scale = compute.in_pass(backward) if hasattr(compute, "in_pass") else 1.0
        for instrs, costs, rest in zip(eng.instrs, eng.costs, eng.rest_per_block, strict=True):
            got["host"] += eng.host_call
            for ins, cost in zip(instrs, costs, strict=True):
                if isinstance(ins, Exchange):
                    got["host"] += eng.exchange_thread_s(cost)
                    got["transport"] += eng.exchange_transport_s(cost)
                elif isinstance(ins, Compute):
                    got["blocks"] += cost
                    got["blocks_alone"] += cost / scale
                    got["host"] += rest  # the call's own work that runs with its blocks
    return got


def markdown(cfg: dict, got: dict[str, float], model: dict[str, float] | None) -> str:
    ms = {k: f"{v * 1e3:.1f}" for k, v in got.items()}
    lines = [
        f"CPU of one {cfg['method']} forward+backward pass, {datetime.date.today()}: "
        f"{cfg['nodes']} x {cfg['ranks_per_node']} ranks, {cfg['cross_rate']}, "
        f"{'causal' if cfg['causal'] else 'full'}, "
        f"{cfg['batch']} x {cfg['seq_local']} tokens per rank, {cfg['heads']} heads "
        f"({cfg['kv_heads']} kv) of {cfg['head_dim']}; ms summed over the ranks (medians of "
        f"{cfg['iters']} passes), the slowest rank's wall {ms['wall']} ms.",
        "",
        "| | process | kernel | calling thread, the rest | transport threads |",
        "|---|---|---|---|---|",
        f"| measured | {ms['process']} | {ms['kernel']} | {ms['thread_rest']} | "
        f"{ms['transport']} |",
    ]
    if model is not None:
        c = {k: f"{v * 1e3:.1f}" for k, v in model.items()}
        total = (model["blocks"] + model["host"] + model["transport"]) * 1e3
        lines.append(
            f"| charged | {total:.1f} | {c['blocks']} (alone {c['blocks_alone']}) | {c['host']} | "
            f"{c['transport']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--cross-rate", default="100mbit")
    ap.add_argument("--method", default="charm")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-local", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", help="a calibrate profile: put its charges next to the CPU")
    ap.add_argument("--md", help="also write the table here")
    add_rank_arguments(ap)  # a rank's: OUT, then CONFIG
    args = ap.parse_args(argv)
    if args.rank_out:
        with open(args.rank_args[0]) as fh:
            rank_main(json.load(fh), args.rank_out)
        return 0
    cfg = {
        k: v for k, v in vars(args).items() if k not in ("profile", "md", "rank_out", "rank_args")
    }
    cfg["kv_heads"] = args.kv_heads or args.heads
    if args.iters < 1 or args.heads % cfg["kv_heads"]:
        raise ValueError(
            f"--iters {args.iters} must be >= 1 and --heads {args.heads} a multiple of "
            f"--kv-heads {cfg['kv_heads']}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        conf = os.path.join(tmp, "cfg.json")
        with open(conf, "w") as fh:
            json.dump(cfg, fh)
        ranks = run_script_ranks(__file__, [conf], args.nodes, args.ranks_per_node, args.cross_rate)
    model = charged(cfg, args.profile) if args.profile else None
    emit(markdown(cfg, measured(ranks), model), args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
