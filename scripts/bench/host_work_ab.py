"""A profile's host work charged another way, for comparison (Note [Host work of a call] in
megatron_charm/sim/profile.py). Everything else stays as calibrated.

``--form traced``: from the attention's trace (the time from a pass's call to its first
instruction, and each exchange's posting, wall seconds scaled to one rank alone), nothing per
byte or in the transport's threads: the host work before the CPU time was measured.
``--form process``: the process's CPU time fitted as one, ``call + post x exchanges`` on the
rank's stream and ``byte x bytes`` in the transport's threads, without telling the calling
thread's share from the transport's.
``--form bytes``: the calling thread's work per pass, exchange and byte, without the term per
element (as ``calibrate`` fitted it before the elements were recorded).
``--form elements``: the calling thread's work with a term per element of the rank's queries,
as ``calibrate`` fits it now; samples taken before the elements were recorded get them from
the calibration's shape (the kernel samples' batch and head dim, the most heads timed).

    python scripts/bench/host_work_ab.py PROFILE.json --form traced --out PROFILE-traced.json

Then replay the same sweep with both (``python -m megatron_charm.sim.testbed ... --profile``).
"""

from __future__ import annotations

import argparse
import json

from megatron_charm.sim.profile import HostWork, fit_nonnegative, host_work
from megatron_charm.sim.topology import parse_gpus


def refit(profile: dict, form: str = "traced") -> dict:
    """``profile`` (its JSON) with the host work refitted in ``form``."""
    samples = profile["provenance"]["samples"]
    if form == "traced":
        m, p = parse_gpus(profile["gpus"])
        raw = {
            "nodes": m,
            "ranks_per_node": p,
            "device": profile["provenance"].get("device", "cpu"),
            "host_work": samples["host_work"],
        }
        work = host_work(raw, profile["compute"]["shared_slots"])
    elif form == "elements":
        kernels = samples["kernel"]
        most = max(k["heads"] for k in kernels)
        per_token = kernels[0]["batch"] * most * kernels[0]["head_dim"]
        cpu = [{"elements": c["s_local"] * per_token, **c} for c in samples["host_cpu"]]
        work = host_work({"device": "cpu", "host_cpu": cpu}, profile["compute"]["shared_slots"])
    elif form == "bytes":
        cpu = [{k: v for k, v in c.items() if k != "elements"} for c in samples["host_cpu"]]
        work = host_work({"device": "cpu", "host_cpu": cpu}, profile["compute"]["shared_slots"])
    elif form == "process":
        cpu = samples["host_cpu"]
        feats = [(1.0, float(c["exchanges"]), float(c["bytes"])) for c in cpu]
        call, post, per_byte = fit_nonnegative(feats, [c["cpu_s"] for c in cpu], (0, 2, 1))
        work = HostWork(call, post, transport_byte=per_byte)
    else:
        raise ValueError(f"--form {form!r}: expected 'traced', 'process', 'bytes' or 'elements'")
    compute = dict(profile["compute"])
    compute.update(
        host_call_s=work.call,
        host_post_s=work.post,
        host_byte_s=work.byte,
        transport_post_s=work.transport_post,
        transport_byte_s=work.transport_byte,
        host_element_fwd_s=work.element_fwd,
        host_element_bwd_s=work.element_bwd,
    )
    name = f"{profile['name']} (host work: {form})"
    return {**profile, "name": name, "compute": compute}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="a profile written by megatron-charm-sim calibrate")
    ap.add_argument("--form", default="traced", choices=("traced", "process", "bytes", "elements"))
    ap.add_argument("--out", required=True, help="where to write the refitted copy")
    args = ap.parse_args()
    with open(args.profile) as f:
        profile = json.load(f)
    old = refit(profile, args.form)
    with open(args.out, "w") as f:
        json.dump(old, f, indent=1)
    c = old["compute"]
    print(
        f"host work: {c['host_call_s'] * 1e3:.3g} ms per pass + {c['host_post_s'] * 1e3:.3g} ms "
        f"per exchange + {c['host_byte_s'] * 1e9:.3g} ns per byte + "
        f"{c['host_element_fwd_s'] * 1e9:.3g} / {c['host_element_bwd_s'] * 1e9:.3g} ns per "
        "query element; transport "
        f"{c['transport_post_s'] * 1e3:.3g} ms per exchange + "
        f"{c['transport_byte_s'] * 1e9:.3g} ns per byte"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
