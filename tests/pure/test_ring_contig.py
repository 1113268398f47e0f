"""The contiguous-layout ring (``ring-contig``): the unbalanced Ring-Attention baseline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_charm.plan import (
    Layout,
    PlanOptions,
    build_plan,
    contiguous_positions,
    sequence_positions,
    zigzag_positions,
)
from megatron_charm.plan.layout import block_cost, block_empty, block_parts, computed_blocks
from megatron_charm.plan.types import Compute, Part
from megatron_charm.plan.validate import ScheduleError, validate


def plan_of(method: str, n: int, causal: bool):
    return build_plan(PlanOptions(method=method), Layout(1, n), causal)


@pytest.mark.parametrize("n", range(1, 13))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_validates_and_computes_the_lower_triangle(n: int, causal: bool) -> None:
    fwd, bwd = validate(plan_of("ring-contig", n, causal))
    for report in (fwd, bwd):
        if causal:
            # rank x computes its diagonal (half a block) and the x full blocks below it
            assert report.blocks == {x: x + 1 for x in range(n)}
            assert report.cost == pytest.approx({x: x + 0.5 for x in range(n)})
        else:
            assert report.blocks == {x: n for x in range(n)}
            assert report.cost == pytest.approx({x: float(n) for x in range(n)})


@pytest.mark.parametrize("n", range(1, 13))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_moves_the_same_bytes_as_the_zigzag_ring(n: int, causal: bool) -> None:
    # The baseline's point: the kv still goes all the way round, whatever a rank skips.
    def sends(method: str) -> list[list[tuple]]:
        return [
            sorted(
                (s.cp_rank, s.channel, s.peer, s.payload.kind, s.payload.part, s.wire)
                for s in report.sends
            )  # fmt: skip
            for report in validate(plan_of(method, n, causal))
        ]

    assert sends("ring-contig") == sends("ring")


@pytest.mark.parametrize("n", [2, 5])
def test_causal_blocks_are_whole_below_the_diagonal(n: int) -> None:
    plan = plan_of("ring-contig", n, True)
    for prog in plan.forward:
        x = prog.cp_rank
        got = {(c.kv_owner, c.q_part, c.kv_part, c.masked) for c in prog.computes()}
        want = {(y, Part.FULL, Part.FULL, y == x) for y in range(x + 1)}
        assert got == want


def test_full_attention_is_the_zigzag_ring() -> None:
    assert plan_of("ring-contig", 4, False).forward == plan_of("ring", 4, False).forward
    assert plan_of("ring-contig", 4, False).backward == plan_of("ring", 4, False).backward


def test_block_rule() -> None:
    assert block_parts(2, 1, True, "contiguous") == (Part.FULL, Part.FULL, False)
    assert block_parts(2, 2, True, "contiguous") == (Part.FULL, Part.FULL, True)
    assert block_empty(1, 2, True, "contiguous") and not block_empty(1, 2, False, "contiguous")
    assert not block_empty(1, 2, True, "zigzag")
    assert [block_cost(2, y, True, "contiguous") for y in range(4)] == [1.0, 1.0, 0.5, 0.0]
    assert computed_blocks(3, True, "contiguous") == {
        (0, 0),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (2, 2),
    }
    assert len(computed_blocks(3, True, "zigzag")) == 9
    with pytest.raises(AssertionError):
        block_parts(1, 2, True, "contiguous")


def test_positions() -> None:
    assert contiguous_positions(1, 4, 16) == [4, 5, 6, 7]
    assert sequence_positions(1, 4, 16, "contiguous") == [4, 5, 6, 7]
    assert sequence_positions(1, 4, 16, "zigzag") == zigzag_positions(1, 4, 16)
    every = sorted(p for r in range(3) for p in contiguous_positions(r, 3, 12))
    assert every == list(range(12))
    with pytest.raises(ValueError, match="divisible by cp_size = 4"):
        contiguous_positions(0, 4, 10)


def test_seq_layout_is_a_method_attribute() -> None:
    assert PlanOptions(method="ring-contig").seq_layout == "contiguous"
    assert {PlanOptions(method=m).seq_layout for m in ("charm", "ring", "all_gather")} == {"zigzag"}


def test_validator_rejects_an_empty_block_computed() -> None:
    plan = plan_of("ring-contig", 2, True)
    prog = plan.forward[0]
    extra = Compute(0, 1, Part.FULL, Part.FULL, False)
    bad = replace(prog, instrs=(*prog.instrs[:-1], extra, prog.instrs[-1]))
    with pytest.raises(ScheduleError, match="empty in the contiguous layout"):
        validate(replace(plan, forward=(bad, plan.forward[1])))


def test_validator_holds_zigzag_methods_to_the_zigzag_rule() -> None:
    # the contiguous programs under the zigzag ring's name: whole kv below the diagonal is wrong
    with pytest.raises(ScheduleError, match="wrong parts"):
        validate(replace(plan_of("ring-contig", 3, True), options=PlanOptions(method="ring")))


def test_trainer_refuses_ring_contig() -> None:
    from megatron_charm.train.config import load_config

    with pytest.raises(ValueError, match=r"parallel.cp_comm_type='ring-contig'.*zigzag.*=ring"):
        load_config(None, ["parallel.cp_comm_type=ring-contig"])


def test_megatron_module_refuses_ring_contig() -> None:
    from megatron_charm.megatron.attention import CHARM_METHODS, resolve_method

    assert "ring-contig" not in CHARM_METHODS
    with pytest.raises(
        ValueError, match=r"cp_comm_type='ring-contig'.*zigzag.*--cp-comm-type ring"
    ):
        resolve_method("ring-contig", None, None)
    with pytest.raises(ValueError, match="zigzag"):
        resolve_method(None, "ring-contig", "charm")
