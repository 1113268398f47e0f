"""Note [Foreign pieces first] against the previous order, in the simulator.

For every point of a grid (hardware preset, two-node layout, heads, tokens per rank; causal,
bf16) this replays charm's default plans twice: as built (the forward runs the first foreign
round inside the own round) and with the rounds in the previous order (own round, then each
foreign piece), and prints the predicted forward and forward+backward of the first over the
second, and the planned attention memory of both.

    python scripts/bench/foreign_first.py --md docs/results/foreign-first-sim.md
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from datetime import datetime, timezone

import megatron_charm.plan as plan_pkg
from megatron_charm.bench.report import emit
from megatron_charm.plan import AttnShape, Layout, PlanOptions, build_plan, pipeline
from megatron_charm.plan.memory import plan_peak
from megatron_charm.sim.predict import Problem, predict
from megatron_charm.sim.topology import PRESETS

LAYOUTS = ((2, 2), (2, 4), (2, 8))
HEADS = ((32, 32), (32, 8))  # (query heads, kv heads), head dim 128
TOKENS = (2048, 8192, 32768)


def _clear_caches() -> None:
    pipeline._shared_memo.cache_clear()
    for name in dir(plan_pkg):
        fn = getattr(plan_pkg, name)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


@contextlib.contextmanager
def previous_order() -> Iterator[None]:
    """Plans built with the own round first and every foreign piece after it."""
    keep = pipeline._Pass.foreign_inside_own
    pipeline._Pass.foreign_inside_own = lambda self, rnds: False  # type: ignore[method-assign]
    _clear_caches()
    try:
        yield
    finally:
        pipeline._Pass.foreign_inside_own = keep  # type: ignore[method-assign]
        _clear_caches()


def point(name: str, m: int, p: int, h: int, h_kv: int, tokens: int) -> tuple[float, ...]:
    """(fwd ratio, fwd+bwd ratio, memory MiB new, memory MiB previous) at one grid point."""
    hw = PRESETS[name]
    compute = hw.compute_model()
    topo = hw.topology(m, p)
    problem = Problem(1, tokens * m * p, h, 128, kv_heads=h_kv, causal=True)
    shape = AttnShape(1, tokens, h, h_kv, 128)

    def run() -> tuple[float, float, float]:
        pred = predict(topo, problem, compute, ("charm",), options=PlanOptions())
        charm = pred.methods["charm"]
        mem = plan_peak(build_plan(PlanOptions(), Layout(m, p), True, shape), shape) / 2**20
        return charm.forward.makespan, charm.total, mem

    new = run()
    with previous_order():
        old = run()
    return new[0] / old[0], new[1] / old[1], new[2], old[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--md", help="write the table here as well")
    args = ap.parse_args()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Simulator, {stamp}: charm's defaults, causal bf16, head dim 128; ratios below 1 mean "
        "the new order is faster.",
        "",
        "| hardware | m x p | heads (kv) | tokens per rank | fwd new / previous | fwd+bwd new / "
        "previous | attention memory MiB new, previous |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("H100", "L20"):
        for m, p in LAYOUTS:
            for h, h_kv in HEADS:
                for tokens in TOKENS:
                    f, t, mem_new, mem_old = point(name, m, p, h, h_kv, tokens)
                    lines.append(
                        f"| {name} | {m} x {p} | {h} ({h_kv}) | {tokens} | {f:.3f} | {t:.3f} | "
                        f"{mem_new:.1f}, {mem_old:.1f} |"
                    )
    text = "\n".join(lines) + "\n"
    emit(text, args.md)


if __name__ == "__main__":
    main()
