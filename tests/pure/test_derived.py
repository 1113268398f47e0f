"""Note [Derived once]: a program's steps and release points, derived once per program object."""

from __future__ import annotations

from megatron_charm import plan as planner
from megatron_charm.comm import derived
from megatron_charm.plan import Layout, PlanOptions
from megatron_charm.plan.coalesce import steps
from megatron_charm.plan.keep import kept_pieces
from megatron_charm.plan.memory import expansion_drops, own_keys, release_points
from megatron_charm.plan.types import Program


def _programs() -> tuple[Program, Program]:
    options, layout = PlanOptions(method="charm"), Layout(2, 4)
    cross, intra = planner.plan_levels(options, layout, True)
    return planner.rank_plan(options, layout, True, cross, 5, intra)


def test_the_derivation_is_the_plain_one_and_is_made_once_per_program() -> None:
    derived.clear()
    fwd, bwd = _programs()
    for prog, backward in ((fwd, False), (bwd, True)):
        own = frozenset(own_keys(5, backward))
        got = derived.pass_steps(prog, own, backward, True, True)
        assert got.steps == tuple(steps(prog.instrs, True))
        assert got.release == dict(release_points(prog, set(own), backward))
        assert got.drops == dict(expansion_drops(prog))
        assert derived.pass_steps(prog, own, backward, True, True) is got
        # without coalescing (a document mask) or expansion: its own entry
        plain = derived.pass_steps(prog, own, backward, False, False)
        assert plain.steps == tuple(steps(prog.instrs, False)) and plain.drops == {}
    assert derived.kept_by(bwd) == kept_pieces(bwd)
    assert derived.kept_by(bwd) is derived.kept_by(bwd)


def test_an_equal_program_that_is_another_object_gets_its_own_entry() -> None:
    """Keyed by identity, not by equality (hashing a program costs a fifth of deriving it)."""
    derived.clear()
    fwd, _ = _programs()
    twin = Program(fwd.cp_rank, tuple(fwd.instrs))
    assert twin == fwd and twin is not fwd
    own = frozenset(own_keys(5, False))
    a = derived.pass_steps(fwd, own, False, True, False)
    b = derived.pass_steps(twin, own, False, True, False)
    assert a is not b and a == b
    assert derived._pass_steps.cache_info().misses == 2


def test_the_benchmark_times_both_passes_of_the_programs_it_names() -> None:
    from tests.bench_scripts import load_bench_script

    options, layout = PlanOptions(method="ring"), Layout(2, 2)
    cross, intra = planner.plan_levels(options, layout, True)
    fwd, bwd = planner.rank_plan(options, layout, True, cross, 0, intra)
    rows = load_bench_script("derive_cost").measure("ring", 2, 2, number=2)
    assert [r.split(" | ")[2:4] for r in rows] == [
        ["forward", str(len(fwd.instrs))],
        ["backward", str(len(bwd.instrs))],
    ]
    assert all(float(r.split(" | ")[4]) > 0 for r in rows)
