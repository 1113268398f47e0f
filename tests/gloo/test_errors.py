"""Bad input raises ValueError naming the value and the fix; a dead rank raises, never hangs."""

from __future__ import annotations

import pytest

from tests.gloo import tasks
from tests.rank_pool import RankPool

CASES = {
    "odd_causal": "even local sequence",
    "lengths_differ": "local_shape_sbhd=(12, 1, 4, 8) vs (8, 1, 4, 8) on cp_rank 0",
    "methods_differ": "options=PlanOptions(method='charm'",
    "options_differ": "cross_return='fp32'",
    "shape_changes_later": "local_shape_sbhd=(12, 1, 4, 8) vs (8, 1, 4, 8) on cp_rank 0",
    "empty": "has an empty dimension",
    "overlapping_calls": "already running on this CPTopology",
    "heads": "multiple of kv heads",
    "dtype": "share one dtype",
    "head_dim": "head dim",
    "kv_shapes": "same shape",
    "method": "unknown CP attention method 'ulysses'",
    "a2a_heads": "h=4 and kv heads h_kv=2 must both be divisible by cp_size=4",
    "a2a_p2p_heads": "h_kv=2 must both be divisible by ranks_per_node=4",
    "format": "unknown qkv_format 'thd'",
    "auto_no_profile": "method='auto' with profile=None",
    "profile_not_auto": "method='charm' with profile='H100'",
    "auto_profiles_differ": "give every rank the same profile",
    "masks_differ": "mask=",
    "mask_total": "DocMask lengths sum to 10 tokens, but the CP group holds 8 x 4 = 32",
    "mask_ring_contig": "document masks describe the zigzag layout",
    "mask_thd_lengths": "not a multiple of 2 * cp_size = 8",
    "mask_window": "window=(-3, 0): sizes must be >= 0, or -1",
    "device": "cannot be communicated",
    "rpn_divide": "ranks_per_node=3",
    "rpn_disagree": "different ranks_per_node [2, 4]",
}


@pytest.mark.gloo
@pytest.mark.parametrize("case", sorted(CASES))
def test_value_errors(pools, case):
    messages = pools(4).run(tasks.expect_value_error, case=case)
    for msg in messages:
        assert msg is not None, f"{case}: no ValueError"
        assert CASES[case] in msg, msg


@pytest.mark.gloo
def test_auto_runs_the_method_it_picks(pools):
    assert pools(4).run(tasks.auto_matches_its_choice) == ["charm"] * 4


@pytest.mark.gloo
def test_one_rank_planning_runs_the_same_programs(pools):
    """Large groups plan one rank each (Note [Planning one rank]); the executor's results are
    bitwise those of the fully replayed plan."""
    assert pools(4).run(tasks.one_rank_planning_matches) == [True] * 4


@pytest.mark.gloo
def test_unequal_nodes(pools):
    messages = pools(3).run(tasks.expect_value_error, case="unequal_nodes")
    for msg in messages:
        assert msg is not None and "unequal numbers of CP ranks" in msg, msg


@pytest.mark.gloo
def test_dead_rank_raises_within_timeout():
    pool = RankPool(2, context=True)
    try:
        got = pool.run_raw(tasks.dead_rank, timeout=120, timeout_s=5.0)
    finally:
        pool.close()
    assert 1 not in got, "rank 1 should have died"
    ok, value = got[0]
    assert ok, value
    name, seconds, message = value
    assert name is not None, "rank 0 returned normally although its peer died"
    assert seconds < 60, f"rank 0 needed {seconds:.1f}s to notice the dead peer"


@pytest.mark.gloo
def test_call_agreement_runs_on_its_own_host_group(pools):
    """No device round trip per call: the fingerprints go over a gloo group of the CP ranks,
    never over the CP group (NCCL in GPU jobs), and mismatches are still caught there."""
    for facts in pools(4).run(tasks.agreement_on_control_group):
        assert facts["backend"] == "gloo" and facts["separate"], facts
        assert facts["ranks"] == [0, 1, 2, 3], facts
        assert facts["out_shape"] == (1, 8, 4, 8)
        assert facts["mismatch"] is not None and "local_shape_sbhd" in facts["mismatch"], facts
