"""Command line: ``python -m megatron_charm.testbed {up,down,run,probe,status,cleanup}``.

Examples::

    python -m megatron_charm.testbed up --nodes 2 --ranks-per-node 2 --cross-rate 100mbit
    python -m megatron_charm.testbed run -- python -c "import os; print(os.environ['RANK'])"
    python -m megatron_charm.testbed probe
    python -m megatron_charm.testbed down

``run`` and ``probe`` use the testbed named ``--name`` (default ``default``) when it is up and no
shape flag is given; otherwise they build a temporary one from the flags and remove it afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from megatron_charm.constants import DEFAULT_TIMEOUT_S
from megatron_charm.testbed.config import PRESET_RATIOS, TOPOLOGIES, TestbedConfig, format_rate
from megatron_charm.testbed.net import TestbedError, netem_available
from megatron_charm.testbed.testbed import STATE_DIR, Testbed, cleanup

_SHAPE_FLAGS = (
    "nodes",
    "ranks_per_node",
    "topology",
    "cross_rate",
    "intra_rate",
    "cross_delay",
    "preset",
    "ack_priority",
)


def _parser() -> argparse.ArgumentParser:
    shape = argparse.ArgumentParser(add_help=False)
    shape.add_argument("--nodes", type=int, help="number of nodes (default 2)")
    shape.add_argument("--ranks-per-node", type=int, help="ranks per node (default 1)")
    shape.add_argument("--topology", choices=TOPOLOGIES, help="cross-node links (default shared)")
    shape.add_argument("--cross-rate", help="cross link rate per direction, e.g. 100mbit, 1gbit")
    shape.add_argument("--intra-rate", help="optional cap on each node's intra-node traffic")
    shape.add_argument("--cross-delay", help="one-way cross link delay, e.g. 1ms (needs netem)")
    shape.add_argument(
        "--no-ack-priority",
        dest="ack_priority",
        action="store_false",
        default=None,
        help="one FIFO per link end: acknowledgements wait behind data, as testbeds before "
        "2026-12-03 (Note [Acknowledgements first])",
    )
    shape.add_argument(
        "--preset",
        choices=sorted(PRESET_RATIOS),
        help="cross rate = (measured or --intra-rate) intra bandwidth / the paper's Table 2 ratio",
    )
    named = argparse.ArgumentParser(add_help=False)
    named.add_argument("--name", help="testbed instance name (default: 'default')")
    named.add_argument(
        "--state-dir",
        default=STATE_DIR,
        help=f"where a running testbed records its configuration (default {STATE_DIR}); "
        "pass the same to every command of one testbed",
    )

    parser = argparse.ArgumentParser(
        prog="python -m megatron_charm.testbed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("up", parents=[shape, named], help="build a testbed and leave it running")
    sub.add_parser("down", parents=[named], help="remove the testbed named --name")
    run = sub.add_parser("run", parents=[shape, named], help="run a command as every rank")
    run.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before ranks are killed"
    )
    run.add_argument("--log-dir", help="write rank<r>.out/.err here instead of the terminal")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")
    probe = sub.add_parser("probe", parents=[shape, named], help="measure link bandwidths")
    probe.add_argument("--repeats", type=int, default=3)
    probe.add_argument("--json", help="also write the full result to this file")
    sub.add_parser("status", help="list testbed namespaces and whether netem exists")
    sub.add_parser(
        "cleanup",
        aliases=["teardown"],
        parents=[named],
        help="remove leftovers of every testbed (or only --name)",
    )
    return parser


def _config(args: argparse.Namespace, name: str) -> TestbedConfig:
    return TestbedConfig(
        nodes=args.nodes if args.nodes is not None else 2,
        ranks_per_node=args.ranks_per_node if args.ranks_per_node is not None else 1,
        topology=args.topology or "shared",
        cross_rate=args.cross_rate,
        intra_rate=args.intra_rate,
        cross_delay=args.cross_delay,
        preset=args.preset,
        ack_priority=args.ack_priority is not False,
        name=name,
    )


def _open(args: argparse.Namespace) -> tuple[Testbed, bool]:
    """The testbed to use and whether this command built it (and must remove it)."""
    shaped = any(getattr(args, f) is not None for f in _SHAPE_FLAGS)
    if not shaped:
        return Testbed.attach(args.name or "default", args.state_dir), False
    cfg = _config(args, args.name or f"p{os.getpid()}")
    return Testbed(cfg, state_dir=args.state_dir), True


def _summary(tb: Testbed) -> str:
    cfg = tb.config
    lines = [
        f"testbed {cfg.name!r}: {cfg.nodes} nodes x {cfg.ranks_per_node} ranks, {cfg.topology}",
        f"  cross links: {format_rate(tb.cross_rate_bps or 0)} per link and direction",
        "  intra-node:  " + (format_rate(tb.intra_rate_bps) if tb.intra_rate_bps else "unshaped"),
    ]
    if tb.measured_intra_bps:
        lines.append(f"  measured intra (gloo): {format_rate(tb.measured_intra_bps)}")
    lines.append("  namespaces:  " + " ".join(tb.namespaces))
    return "\n".join(lines)


def _probe_table(result: dict) -> str:
    rows = ["phase      pairs  bytes/pair   seconds  aggregate      per link vs configured"]
    for ph in result["phases"]:
        ratio = ph.get("per_link_vs_configured")
        rows.append(
            f"{ph['name']:<10} {len(ph['pairs']):>5}  {ph['bytes_per_pair']:>10}  "
            f"{ph['seconds_median']:>8.3f}  {format_rate(ph['aggregate_bps']):>13}  "
            + (f"{format_rate(ph['per_link_bps'])} = {ratio:.1%}" if ratio else "")
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.verb == "up":
            cfg = _config(args, args.name or "default")
            tb = Testbed(cfg, persistent=True, state_dir=args.state_dir)
            with tb:
                print(_summary(tb))
            return 0
        if args.verb == "down":
            removed = cleanup(args.name or "default", args.state_dir)
            print("removed: " + (" ".join(removed) or "nothing"))
            return 0
        if args.verb in ("cleanup", "teardown"):
            removed = cleanup(args.name, args.state_dir)
            print("removed: " + (" ".join(removed) or "nothing"))
            return 0
        if args.verb == "status":
            from megatron_charm.testbed.net import list_namespaces

            print("namespaces: " + (" ".join(list_namespaces()) or "none"))
            print(f"netem qdisc: {'available' if netem_available() else 'not available'}")
            return 0
        tb, owned = _open(args)
        # A temporary testbed is built and removed by its context; an attached one is left up.
        with tb if owned else contextlib.nullcontext(tb):
            print(_summary(tb), file=sys.stderr)
            if args.verb == "run":
                return _run(tb, args)
            return _probe(tb, args)
    except (TestbedError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: ranks stopped, temporary testbed removed", file=sys.stderr)
        return 130


def _run(tb: Testbed, args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ValueError("run needs a command after '--', e.g. run -- python train.py")
    res = tb.run(cmd, timeout_s=args.timeout, log_dir=args.log_dir)
    if res.timed_out:
        print(f"error: timed out after {res.elapsed_s:.1f} s; ranks killed", file=sys.stderr)
        return 124
    if not res.ok:
        bad = res.ranks[res.first_failure]
        print(
            f"error: rank {bad.global_rank} exited with {bad.returncode}; others stopped",
            file=sys.stderr,
        )
        return bad.returncode if bad.returncode and bad.returncode > 0 else 1
    return 0


def _probe(tb: Testbed, args: argparse.Namespace) -> int:
    from megatron_charm.testbed.probe import probe

    result = probe(tb, repeats=args.repeats)
    print(_probe_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
