"""``scripts/bench/plan_scale.py`` measures a rank's first call: nothing planned before counts."""

from __future__ import annotations

from megatron_charm.plan import Layout, PlanOptions, plan_levels
from tests.bench_scripts import load_bench_script


def _cached(modules) -> dict[str, int]:
    return {
        f"{module.__name__}.{name}": value.cache_info().currsize
        for module in modules
        for name, value in vars(module).items()
        if callable(getattr(value, "cache_info", None))
    }


def test_clear_forgets_every_planning_cache_including_the_auto_choices():
    plan_scale = load_bench_script("plan_scale")
    plan_levels(PlanOptions(method="charm"), Layout(2, 4), True)
    filled = {k for k, n in _cached(plan_scale._CACHED_MODULES).items() if n}
    # the choices that replay a small layout, the same at every CP size
    assert {"megatron_charm.plan._auto_keep", "megatron_charm.plan._auto_intra"} <= filled
    plan_scale._clear()
    assert not any(_cached(plan_scale._CACHED_MODULES).values())
