"""A profile's host work charged the old way, for comparison: from the attention's trace (the
time from a pass's call to its first instruction, and each exchange's posting, wall seconds
scaled to one rank alone), with no cost per byte, instead of the CPU time of calls with a null
kernel (Note [Host work of a call] in megatron_charm/sim/profile.py). Everything else stays as
calibrated.

    python scripts/bench/host_work_ab.py PROFILE.json --out PROFILE-traced.json

Then replay the same sweep with both (``python -m megatron_charm.sim.testbed ... --profile``).
"""

from __future__ import annotations

import argparse
import json

from megatron_charm.sim.profile import host_work
from megatron_charm.sim.topology import parse_gpus


def refit(profile: dict) -> dict:
    """``profile`` (its JSON) with the host work refitted from the trace."""
    samples = profile["provenance"]["samples"]
    m, p = parse_gpus(profile["gpus"])
    raw = {
        "nodes": m,
        "ranks_per_node": p,
        "device": profile["provenance"].get("device", "cpu"),
        "host_work": samples["host_work"],
    }
    call, post, per_byte = host_work(raw, profile["compute"]["shared_slots"])
    compute = dict(profile["compute"])
    compute.update(host_call_s=call, host_post_s=post, host_byte_s=per_byte)
    name = f"{profile['name']} (host work: traced)"
    return {**profile, "name": name, "compute": compute}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="a profile written by megatron-charm-sim calibrate")
    ap.add_argument("--out", required=True, help="where to write the refitted copy")
    args = ap.parse_args()
    with open(args.profile) as f:
        profile = json.load(f)
    old = refit(profile)
    with open(args.out, "w") as f:
        json.dump(old, f, indent=1)
    c = old["compute"]
    print(
        f"host work: {c['host_call_s'] * 1e3:.3g} ms per pass + {c['host_post_s'] * 1e3:.3g} ms "
        "per exchange"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
