"""Attention demo: CHARM+ on CPU ranks (gloo) against the single-process result.

``python -m megatron_charm.demo [--ranks 4] [--ranks-per-node 2] [--method charm]`` starts its own
ranks, runs causal CP attention forward and backward on a zigzag-split sequence, and prints the
largest difference from plain attention on the whole sequence.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megatron_charm.launch import RankInfo, run_function


def _rank_main(info: RankInfo, args: argparse.Namespace) -> None:
    import megatron_charm as mc
    from megatron_charm import env
    from megatron_charm.kernels.backends import _KERNELS
    from megatron_charm.plan import zigzag_positions

    torch.set_num_threads(1)
    cp_rank = info.global_rank
    info.init_process_group("gloo")
    # an entry point: the node identity comes from the environment here, as data below
    topo = mc.CPTopology.build(None, ranks_per_node=args.ranks_per_node, node_id=env.node_id())
    b, seq, h, h_kv, d = 2, args.seq, 8, 2, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, seq, hh, d, generator=gen) for hh in (h, h_kv, h_kv, h))
    idx = torch.tensor(zigzag_positions(cp_rank, args.ranks, seq))
    lq, lk, lv = (t[:, idx].clone().requires_grad_() for t in (q, k, v))
    out = mc.cp_attention(lq, lk, lv, topo, method=args.method, causal=True)
    out.backward(dout[:, idx])

    # the single-process result on the whole sequence, float64
    gq, gk, gv = (t.double().transpose(0, 1).requires_grad_() for t in (q, k, v))
    ref, lse = _KERNELS["math"].forward(gq, gk, gv, True, d**-0.5)
    grads = _KERNELS["math"].backward(
        dout.double().transpose(0, 1), gq, gk, gv, ref, lse, True, d**-0.5
    )
    errs = {
        "out": (out.double() - ref.transpose(0, 1)[:, idx]).abs().max().item(),
        "dq": (lq.grad.double() - grads[0].transpose(0, 1)[:, idx]).abs().max().item(),
        "dk": (lk.grad.double() - grads[1].transpose(0, 1)[:, idx]).abs().max().item(),
        "dv": (lv.grad.double() - grads[2].transpose(0, 1)[:, idx]).abs().max().item(),
    }
    table: list = [None] * args.ranks
    dist.all_gather_object(table, (idx[:2].tolist(), errs))
    if cp_rank == 0:
        print(topo.describe())
        print(
            f"method={args.method} causal attention, global seq {seq}, batch {b}, heads {h} "
            f"(kv heads {h_kv}), head dim {d}, float32"
        )
        for r, (first, e) in enumerate(table):
            print(
                f"  cp_rank {r}: tokens from {first[0]} (zigzag); max |diff| vs single process: "
                + ", ".join(f"{n} {v:.1e}" for n, v in e.items())
            )
        worst = max(max(e.values()) for _, e in table)
        print(f"largest difference {worst:.2e}: " + ("OK" if worst < 1e-4 else "TOO LARGE"))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--method", default="charm")
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args(argv)
    run_function(_rank_main, args, nproc=args.ranks)


if __name__ == "__main__":
    main()
