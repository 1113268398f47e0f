"""A profile's blocks priced the old way, for comparison: its kernel samples at the most heads
timed only (the configured heads, with calibrate's default --kernel-heads), fitted as a cost per
call plus FLOPs at a rate (no cost per row element; Note [Block shapes] in
megatron_charm/sim/compute.py). Everything else stays as calibrated.

    python scripts/bench/kernel_fit_ab.py PROFILE.json --out PROFILE-callrate.json

Then replay the same sweep with both (``python -m megatron_charm.sim.testbed ... --profile``).
"""

from __future__ import annotations

import argparse
import json

from megatron_charm.sim.compute import BWD_FLOPS_RATIO
from megatron_charm.sim.profile import block_flops_full, fit_line


def refit(profile: dict) -> dict:
    """``profile`` (its JSON) with the kernel terms refitted the old way."""
    samples = profile["provenance"]["samples"]["kernel"]
    most = max(k["heads"] for k in samples)
    kept = [k for k in samples if k["heads"] == most]
    flops = [block_flops_full(k["batch"], k["heads"], k["head_dim"], k["tokens"]) for k in kept]
    f0, f1 = fit_line(flops, [k["fwd_s"] for k in kept])
    b0, b1 = fit_line([BWD_FLOPS_RATIO * x for x in flops], [k["bwd_s"] for k in kept])
    compute = dict(profile["compute"])
    compute.update(
        fwd_overhead=f0,
        bwd_overhead=b0,
        fwd_flops_per_s=1.0 / f1,
        bwd_flops_per_s=1.0 / b1,
        fwd_per_element=0.0,
        bwd_per_element=0.0,
    )
    name = f"{profile['name']} (blocks: call + FLOPs at {most} heads)"
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
        f"forward {c['fwd_overhead'] * 1e6:.0f} us + {c['fwd_flops_per_s'] / 1e12:.4g} TFLOP/s, "
        f"backward {c['bwd_overhead'] * 1e6:.0f} us + {c['bwd_flops_per_s'] / 1e12:.4g} TFLOP/s"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
