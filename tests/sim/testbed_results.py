"""A small benchmark result of the CPU testbed, as ``megatron-charm-bench attention`` writes it,
for the tests of :mod:`megatron_charm.sim.testbed`."""

from __future__ import annotations


def bench_result(fwd_ms: dict[str, float], heads: int = 4) -> dict:
    """A 2 x 2 shared-link result at 100 Mbit/s (1 x 1024 tokens per rank, ``heads`` of 64,
    causal, bf16) whose methods took ``fwd_ms`` in the forward and three times that in the
    forward+backward (medians)."""
    return {
        "layout": [2, 2],
        "topology": "shared",
        "cross_bps": 100e6,
        "pure_compute_s": {"fwd": 0.4, "fwdbwd": 2.4},
        "config": {
            "batch": 1,
            "seq_local": 1024,
            "heads": heads,
            "kv_heads": heads,
            "head_dim": 64,
            "dtype": "bf16",
            "causal": True,
            "iters": 3,
            "methods": sorted(fwd_ms),
        },
        "methods": {
            m: {"fwd": {"median": t / 1e3}, "fwdbwd": {"median": 3 * t / 1e3}}
            for m, t in fwd_ms.items()
        },
    }
