"""Command line of the benchmarks: ``python -m megatron_charm.bench <subcommand>``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-charm-bench``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:  # internal: one rank of 'attention'
        from megatron_charm.bench.worker import main as worker_main
        from megatron_charm.launch.call import leave_rank

        worker_main(argv[1])
        leave_rank(0)  # Note [Leaving a rank process]
    ap = argparse.ArgumentParser(prog="megatron-charm-bench", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    from megatron_charm.bench import attention, memory, numerics, planning

    attention.add_arguments(sub.add_parser("attention", help="side-by-side attention timings"))
    numerics.add_arguments(sub.add_parser("numerics", help="Table 8: errors vs float64"))
    memory.add_arguments(sub.add_parser("memory", help="Table 3: buffers, ring vs charm"))
    planning.add_arguments(sub.add_parser("planning", help="cost of planning a new mask"))
    tl = sub.add_parser("timeline", help="per-instruction timeline from an attention --raw file")
    tl.add_argument("raw")
    tl.add_argument("--method", default="charm")
    tl.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
    tl.add_argument("--iteration", type=int, default=None, help="default: the median one")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "attention":
            attention.run_attention(args)
        elif args.cmd == "timeline":
            import json

            from megatron_charm.bench.summary import format_timeline

            with open(args.raw) as f:
                print(format_timeline(json.load(f), args.method, args.mode, args.iteration))
        elif args.cmd == "numerics":
            numerics.run_numerics(args)
        elif args.cmd == "planning":
            planning.run_planning(args)
        else:
            memory.run_memory(args)
    except ValueError as exc:
        ap.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
