"""No hang at model build: CHARM+'s groups are built where every rank passes, and ranks that
disagree on the node split all raise instead of waiting in different group creations."""

from __future__ import annotations

import pytest

WORKLOADS = "tests.integration.group_build_workloads"

pytestmark = pytest.mark.gloo


def test_pipeline_stage_without_attention_does_not_hang(pool4):
    results = pool4.run(f"{WORKLOADS}:stage_without_attention", timeout=180)
    by_stage = {0: [], 1: []}
    for result in results:
        by_stage[result["stage"]].append(result)
    assert len(by_stage[0]) == 2 and len(by_stage[1]) == 2
    # Stage 0's attention found the groups built up front and ran on them.
    assert all(r["reused"] and r["shape"] == (8, 1, 16) for r in by_stage[0])
    assert all(r["reused"] is None for r in by_stage[1])


@pytest.mark.parametrize(
    "kind,fragment",
    [
        ("ranks_per_node", "global ranks [0]: ranks_per_node=4"),
        ("detected", "global ranks [0]: ranks_per_node=None"),
        ("invalid", "invalid on global ranks [1]"),
    ],
)
def test_ranks_that_disagree_on_the_node_split_all_raise(pool4, kind, fragment):
    errors = pool4.run(f"{WORKLOADS}:disagreeing_split", kind, timeout=180)
    assert all(e is not None and fragment in e for e in errors), errors
    if kind != "invalid":
        assert all("--charm-ranks-per-node" in e for e in errors)


def test_clear_topology_cache_destroys_the_topologies(pool4):
    """A job that tears its parallel state down and sets it up again keeps no earlier
    topology's groups, and a module still holding a cleared topology gets a ValueError."""
    for rounds in pool4.run(f"{WORKLOADS}:cleared_topologies", 2, timeout=180):
        assert len(rounds) == 2
        for held, emptied, error in rounds:
            assert held == 0 and emptied
            assert error is not None and "was destroyed" in error, error
