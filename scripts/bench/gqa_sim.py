"""Simulated GQA grid: Llama-style shapes on the paper's H100 clusters, charm (q or kv crossing,
and the default choice) against ring, with rails and with one shared NIC per node.

    python scripts/bench/gqa_sim.py > docs/results/gqa-sim.md
"""

from __future__ import annotations

import datetime

from megatron_charm.plan import Layout, PlanOptions, build_plan
from megatron_charm.sim.predict import Problem, predict
from megatron_charm.sim.topology import PRESETS

SHAPES = [("32 x 128 over 8 kv heads", 32, 8, 128), ("64 x 128 over 8 kv heads", 64, 8, 128)]
CLUSTERS = [(2, 8), (4, 8)]
SEQS = [32768, 131072]


def main() -> None:
    h100 = PRESETS["H100"]
    compute = h100.compute_model()
    print(f"Generated {datetime.date.today()} by `python scripts/bench/gqa_sim.py`.")
    print(
        "H100 preset (its efficiency, achieved cross rate and enqueue cost; docs/simulator.md), "
        "causal, batch 1, bf16; one attention layer; `rails`: one cross link per GPU, `shared`: "
        "one per node. Times are forward / backward in ms; speedup of the default over ring.\n"
    )
    print("| shape | GPUs | links | seq | ring | charm q | charm kv | default (picks) | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, h, h_kv, d in SHAPES:
        for m, p in CLUSTERS:
            for links in ("rails", "shared"):
                topo = h100.topology(m, p, cross_links=links, nics_per_node=0)
                for seq in SEQS:
                    problem = Problem(1, seq, h, d, kv_heads=h_kv, causal=True)
                    cells = {}
                    for label, options in (
                        ("ring", PlanOptions(method="ring")),
                        ("q", PlanOptions(cross_level="q")),
                        ("kv", PlanOptions(cross_level="kv")),
                        ("auto", PlanOptions()),
                    ):
                        pred = predict(topo, problem, compute, (options.method,), options=options)
                        mp = pred.methods[options.method]
                        cells[label] = (mp.forward.makespan * 1e3, mp.backward.makespan * 1e3)
                    ring, auto = cells["ring"], cells["auto"]
                    picks = build_plan(
                        PlanOptions(), Layout(m, p), True, problem.shape(m * p)
                    ).cross
                    fmt = {k: f"{v[0]:.1f} / {v[1]:.1f}" for k, v in cells.items()}
                    speed = f"{ring[0] / auto[0]:.2f}x / {ring[1] / auto[1]:.2f}x"
                    print(
                        f"| {name} | {m}x{p} | {links} | {seq // 1024}K | {fmt['ring']} | "
                        f"{fmt['q']} | {fmt['kv']} | {fmt['auto']} ({picks[0]}/{picks[1]}) | "
                        f"{speed} |"
                    )


if __name__ == "__main__":
    main()
