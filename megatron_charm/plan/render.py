"""Text drawings of plans for the docs and for debugging.

Two views: the block matrix (who computes block (q of x, kv of y), and how the inputs met), and
one rank's program as a list of instructions.
"""

from __future__ import annotations

import argparse
import time

from megatron_charm.plan import Layout, PlanOptions, build_plan
from megatron_charm.plan.cost import cross_link_bytes, plan_bytes
from megatron_charm.plan.options import add_plan_arguments, plan_values_from_args
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Exchange, Merge, Op, Plan, Wait, Wire
from megatron_charm.plan.validate import validate


def block_matrix(plan: Plan) -> str:
    """Rows: q owner x; columns: kv owner y. Cell: computing rank and how inputs met there.

    ``D`` diagonal, ``k`` kv came to the q owner, ``q`` q went to the kv owner, ``x`` q crossed
    nodes, ``r`` ring step (kv forwarded), ``.`` an empty block (causal, contiguous layout),
    ``h*`` computed on head groups (a2a: by every rank; a2a+p2p: by every rank of the q owner's
    node; a2a+charm: by every rank of their node), ``x*`` q crossed nodes and was computed on
    head groups by every rank of the kv owner's node (a2a+charm).
    """
    n = plan.layout.cp_size
    where: dict[tuple[int, int], int] = {}
    for prog in plan.forward:
        for ins in prog.instrs:
            if isinstance(ins, Compute):
                where[(ins.q_owner, ins.kv_owner)] = prog.cp_rank
    p = plan.layout.ranks_per_node if plan.method == "charm" else n
    width = len(str(n - 1)) + 2
    lines = ["q\\kv " + "".join(f"{y:>{width}}" for y in range(n))]
    for x in range(n):
        cells = []
        for y in range(n):
            c = where.get((x, y))
            if plan.method in ("a2a", "a2a+p2p"):
                cells.append("h*".rjust(width))
                continue
            if plan.method == "a2a+charm":
                same = plan.layout.node(x) == plan.layout.node(y)
                cells.append(("h*" if same else "x*").rjust(width))
                continue
            if c is None:
                cells.append(".".rjust(width))
                continue
            if x == y:
                tag = "D"
            elif plan.method in ("ring", "ring-contig"):
                tag = "r"
            elif x // p != y // p:
                tag = "x"
            elif c == x:
                tag = "k"
            else:
                tag = "q"
            cells.append(f"{tag}{c}".rjust(width))
        lines.append(f"{x:>4} " + "".join(cells))
    return "\n".join(lines)


def program_listing(plan: Plan, cp_rank: int, backward: bool = False) -> str:
    prog = (plan.backward if backward else plan.forward)[cp_rank]
    out = []
    for ins in prog.instrs:
        if isinstance(ins, Exchange):
            ops = ", ".join(
                f"{'->' if op.send else '<-'}{op.peer} {_payload(op)}" for op in ins.ops
            )
            out.append(f"  post #{ins.handle:<2} {ins.channel:<9} {ops}")
        elif isinstance(ins, Wait):
            out.append(f"  wait #{ins.handle}")
        elif isinstance(ins, Compute):
            mask = " causal" if ins.masked else ""
            heads = "" if ins.heads is None else f" {ins.heads}"
            out.append(
                f"  compute q{ins.q_owner}.{ins.q_part.value} x kv{ins.kv_owner}."
                f"{ins.kv_part.value}{mask}{heads}"
            )
        elif isinstance(ins, Merge):
            out.append(f"  merge {ins.payload} (from #{ins.handle} <-{ins.peer})")
    return "\n".join(out)


def _payload(op: Op) -> str:
    """A payload, with its precision when a partial travels in float32."""
    return f"{op.payload}/fp32" if op.wire == Wire.FP32 else str(op.payload)


def bytes_table(n: int, p: int, causal: bool, shape: AttnShape, cross_level: str = "auto") -> str:
    """Markdown table: KiB sent per rank (mean over ranks), per method, pass and channel kind;
    charm's rows use ``cross_level``."""
    kinds = ("kv", "q", "o", "cross.q", "cross.kv", "cross.o")
    rows = [
        "| method | pass | kv | q / bundle | out / grads | cross q | cross kv | cross out "
        "| total |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method in ("ring", "all_gather", "a2a", "a2a+p2p", "a2a+charm", "merge", "rm+", "charm"):
        fwd, bwd = plan_bytes(
            build_plan(
                PlanOptions(method=method, cross_level=cross_level),
                Layout(n // p, p),
                causal,
                shape,
            ),
            shape,
        )
        for name, per_rank in (("fwd", fwd), ("bwd", bwd)):
            sums = dict.fromkeys(kinds, 0)
            for chans in per_rank.values():
                for ch, b in chans.items():
                    key = ch if ch.startswith("cross") else ch.split(".")[1]
                    sums[key] += b
            cols = [sums[k] / n for k in kinds]
            cells = " | ".join(_kib(c) for c in [*cols, sum(cols)])
            rows.append(f"| {method} | {name} | {cells} |")
    return "\n".join(rows)


def cross_level_table(layout: Layout, causal: bool, shape: AttnShape) -> str:
    """Markdown table: MB on the busiest directed cross-node link, forward / backward, of ring
    and of charm with q or kv crossing, for every kv head count that divides ``shape.h``."""
    rows = [
        "| kv heads (g) | ring | charm, q crosses | charm, kv crosses | auto picks |",
        "|---|---|---|---|---|",
    ]
    for h_kv in sorted((k for k in range(1, shape.h + 1) if shape.h % k == 0), reverse=True):
        s = AttnShape(shape.b, shape.s_local, shape.h, h_kv, shape.d, shape.itemsize)
        cells = []
        for options in (
            PlanOptions(method="ring"),
            PlanOptions(cross_level="q"),
            PlanOptions(cross_level="kv"),
        ):
            plan = build_plan(options, layout, causal, s)
            busiest = [
                max(cross_link_bytes(plan.programs(bwd), layout, s).values(), default=0) / 1e6
                for bwd in (False, True)
            ]
            cells.append(f"{busiest[0]:.1f} / {busiest[1]:.1f}")
        auto = build_plan(PlanOptions(), layout, causal, s).cross
        tag = "MHA" if h_kv == shape.h else f"{shape.h // h_kv}:1"
        rows.append(f"| {h_kv} ({tag}) | " + " | ".join(cells) + f" | {auto[0]} / {auto[1]} |")
    return "\n".join(rows)


def _kib(b: float) -> str:
    return "-" if b == 0 else f"{b / 1024:.0f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--method", default="charm")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=4)
    ap.add_argument(
        "--cp-rank",
        "--rank",
        dest="cp_rank",
        type=int,
        default=None,
        help="also list the program of this CP position (--rank: its older name)",
    )
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--no-matrix", action="store_true", help="list the program only")
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--bytes", action="store_true", help="print the bytes table instead")
    ap.add_argument(
        "--cross-bytes",
        action="store_true",
        help="print the busiest cross link's MB per kv head count (s_local 2048, d 64, bf16)",
    )
    ap.add_argument("--cross-level", choices=("auto", "q", "kv"), default="auto")
    ap.add_argument("--heads", type=int, default=8, help="query heads (for cross-level auto)")
    ap.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: --heads)")
    keys = (
        "window",
        "combine_nodes",
        "cross_return",
        "intra_level",
        "foreign_q",
        "memory_budget",
    )
    add_plan_arguments(ap, keys=keys)
    ap.add_argument(
        "--validate",
        action="store_true",
        help="replay every rank's forward and backward program (the full check that groups "
        "above FULL_CHECK_MAX_CP ranks skip at job start) and print the result",
    )
    args = ap.parse_args(argv)
    if args.cross_bytes:
        shape = AttnShape(b=1, s_local=2048, h=args.heads, h_kv=args.heads, d=64, itemsize=2)
        layout = Layout(args.nodes, args.ranks_per_node)
        print(cross_level_table(layout, not args.non_causal, shape))
        return
    if args.bytes:
        shape = AttnShape(b=1, s_local=4096, h=8, h_kv=8, d=64, itemsize=2)
        n = args.nodes * args.ranks_per_node
        print(bytes_table(n, args.ranks_per_node, not args.non_causal, shape, args.cross_level))
        return
    extra = plan_values_from_args(args, keys=keys)
    options = PlanOptions(method=args.method, cross_level=args.cross_level, **extra)
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    try:
        shape = AttnShape(b=1, s_local=2, h=args.heads, h_kv=kv_heads, d=64)
    except ValueError as err:
        ap.error(f"--heads {args.heads} / --kv-heads {kv_heads}: {err}")
    layout = Layout(args.nodes, args.ranks_per_node)
    if args.cp_rank is not None and not 0 <= args.cp_rank < layout.cp_size:
        ap.error(
            f"--cp-rank {args.cp_rank}: a CP position is 0..{layout.cp_size - 1} on "
            f"{args.nodes} x {args.ranks_per_node} ranks; pass one of those, or change --nodes "
            "and --ranks-per-node"
        )
    plan = build_plan(options, layout, not args.non_causal, shape)
    if args.validate:
        start = time.perf_counter()
        validate(plan)
        count = sum(len(p.instrs) for p in plan.forward + plan.backward)
        print(
            f"valid: {options} on {layout.num_nodes}x{layout.ranks_per_node}, "
            f"{'causal' if not args.non_causal else 'full'}, {count} instructions replayed in "
            f"{time.perf_counter() - start:.1f} s"
        )
        return
    if plan.method == "charm" and layout.num_nodes > 1:
        print(f"across nodes: {plan.cross[0]} (forward), {plan.cross[1]} (backward)")
    if plan.method == "charm" and layout.ranks_per_node > 2:
        print(f"inside nodes: {plan.intra[0]} (forward), {plan.intra[1]} (backward)")
    if not args.no_matrix:
        print(block_matrix(plan) + "\n")
    if args.cp_rank is not None:
        print(f"cp_rank {args.cp_rank}, {'backward' if args.backward else 'forward'}:")
        print(program_listing(plan, args.cp_rank, args.backward))


if __name__ == "__main__":
    main()
