"""``megatron-charm-bench timeline``: each rank's instructions of one timed call, its waits, and
when the call returned after its last instruction (Note [Where a call's host work runs])."""

from __future__ import annotations

import pytest

from megatron_charm.bench.summary import format_timeline


def _raw(wall: float | None) -> dict:
    events = [
        ["fwd", "Exchange", "cross.q", 0.002, 0.0021],
        ["fwd", "Compute", "", 0.0021, 0.010],
        ["fwd", "Wait", "cross.q", 0.010, 0.012],
        ["fwd", "Merge", "", 0.012, 0.0125],
    ]
    rec = {"events": events, "wall": wall} if wall is not None else {"events": events}
    return {"ranks": [{"cp_rank": 0, "recs": {"charm": {"fwd": [rec]}}}]}


def test_the_timeline_ends_each_rank_with_the_calls_return() -> None:
    text = format_timeline(_raw(0.0131), "charm", "fwd", 0)
    lines = text.splitlines()
    assert lines[1] == "cp_rank 0:"
    assert "compute 8 ms; waits fwd:cross.q 2" in text
    assert lines[-1] == "  returned at 13.1 ms, 0.6 ms after its last instruction"
    # results from before the call's return was recorded: no such line
    assert "returned" not in format_timeline(_raw(None), "charm", "fwd", 0)


def test_a_method_without_a_trace_is_refused() -> None:
    raw = _raw(0.01)
    raw["ranks"][0]["recs"]["charm"]["fwd"][0]["events"] = []
    with pytest.raises(ValueError, match="only our methods are traced"):
        format_timeline(raw, "charm", "fwd", 0)
