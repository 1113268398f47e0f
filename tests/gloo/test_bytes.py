"""The executor moves exactly the bytes the planner counts, and holds exactly the memory it
counts, per rank."""

from __future__ import annotations

import pytest

from megatron_charm.plan import AttnShape, Layout, PlanOptions, build_plan
from megatron_charm.plan.cost import plan_bytes
from megatron_charm.plan.keep import kept_pieces
from megatron_charm.plan.memory import pass_memory
from tests.gloo import tasks


@pytest.mark.gloo
@pytest.mark.parametrize(
    "method,p",
    [("ring", 4), ("merge", 4), ("rm+", 4), ("all_gather", 4), ("charm", 2), ("charm", 1)]
    + [("ring-contig", 4)],
)
@pytest.mark.parametrize("causal", [True, False])
def test_executor_bytes_equal_plan(pools, method, p, causal):
    n = 4
    got = pools(n).run(tasks.bytes_moved, method=method, ranks_per_node=p, causal=causal)
    shape = AttnShape(b=1, s_local=8, h=4, h_kv=2, d=8, itemsize=2)
    plan = build_plan(PlanOptions(method=method), Layout(n // p, p), causal, shape)
    want_fwd, want_bwd = plan_bytes(plan, shape)
    for x in range(n):
        assert got[x][0] == want_fwd.get(x, {}), f"forward, cp_rank {x}"
        assert got[x][1] == want_bwd.get(x, {}), f"backward, cp_rank {x}"


@pytest.mark.gloo
@pytest.mark.parametrize("causal", [True, False])
def test_kept_foreign_q_executor_bytes_equal_plan(pools, causal):
    # Note [Keeping foreign queries]: with MHA the default plan ships q in both passes and keeps
    # the forward's foreign q (Note [Cross level]), and the executor sends bundles without it
    n, p = 4, 2
    got = pools(n).run(
        tasks.bytes_moved, method="charm", ranks_per_node=p, causal=causal, h=4, h_kv=4
    )
    shape = AttnShape(b=1, s_local=8, h=4, h_kv=4, d=8, itemsize=2)
    plan = build_plan(PlanOptions(), Layout(n // p, p), causal, shape)
    assert plan.cross == ("q", "dout")
    want_fwd, want_bwd = plan_bytes(plan, shape)
    for x in range(n):
        assert got[x] == [want_fwd[x], want_bwd[x]], f"cp_rank {x}"


@pytest.mark.gloo
@pytest.mark.parametrize("method,p", [("a2a", 4), ("a2a+p2p", 2), ("a2a+charm", 2)])
def test_head_split_executor_bytes_equal_plan(pools, method, p):
    # the heads must split over the four ranks (a2a) or a node (a2a+p2p): GQA 8:4; causal only
    # (both move whole tokens either way, which tests/pure/test_bytes.py checks)
    causal = True
    n, shape = 4, AttnShape(b=1, s_local=8, h=8, h_kv=4, d=8, itemsize=2)
    got = pools(n).run(
        tasks.bytes_moved, method=method, ranks_per_node=p, causal=causal, h=8, h_kv=4
    )
    plan = build_plan(PlanOptions(method=method), Layout(n // p, p), causal, shape)
    want_fwd, want_bwd = plan_bytes(plan, shape)
    for x in range(n):
        assert got[x] == [want_fwd[x], want_bwd[x]], f"cp_rank {x}"


@pytest.mark.gloo
@pytest.mark.parametrize(
    "method,p,options",
    [
        ("ring", 4, {}),
        ("merge", 4, {}),
        ("rm+", 4, {}),
        ("all_gather", 4, {}),
        ("a2a", 4, {}),  # head groups sliced from all heads: send copies
        ("a2a+p2p", 2, {}),
        ("a2a+charm", 2, {}),
        ("charm", 2, {}),
        ("charm", 4, {"intra_level": "split"}),
        ("charm", 4, {"intra_level": "kv"}),
        # Note [Keeping foreign queries]: kept q pieces count in both passes
        ("charm", 2, {"cross_level": "q", "foreign_q": "keep"}),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_executor_memory_equals_plan(pools, method, p, options, causal):
    # Note [Memory of a pass]: the executor's own accounting of what it allocates equals the
    # planner's replay of the same programs, byte for byte
    n = 4
    got = pools(n).run(
        tasks.peak_bytes, method=method, ranks_per_node=p, causal=causal, options=options
    )
    shape = AttnShape(b=2, s_local=8, h=8, h_kv=4, d=8, itemsize=2)
    plan = build_plan(PlanOptions(method=method, **options), Layout(n // p, p), causal, shape)
    for x in range(n):
        kept = kept_pieces(plan.backward[x])
        want = [pass_memory(plan.programs(bwd)[x], shape, bwd, kept=kept) for bwd in (False, True)]
        assert got[x] == want, f"cp_rank {x}"
        assert min(want) > 0


@pytest.mark.gloo
@pytest.mark.parametrize("causal", [True, False])
def test_tasp_executor_bytes_and_memory_equal_plan(pools, causal):
    # Note [TASP schedule]: chunks of a third of each half at n = 4, so s_local divides by 6
    n, s_local = 4, 12
    got = pools(n).run(
        tasks.bytes_moved, method="tasp", ranks_per_node=n, causal=causal, s_local=s_local
    )
    shape = AttnShape(b=1, s_local=s_local, h=4, h_kv=2, d=8, itemsize=2)
    plan = build_plan(PlanOptions(method="tasp"), Layout(1, n), causal, shape)
    want_fwd, want_bwd = plan_bytes(plan, shape)
    for x in range(n):
        assert got[x] == [want_fwd[x], want_bwd[x]], f"cp_rank {x}"
    peaks = pools(n).run(
        tasks.peak_bytes, method="tasp", ranks_per_node=n, causal=causal, s_local=s_local
    )
    shape = AttnShape(b=2, s_local=s_local, h=8, h_kv=4, d=8, itemsize=2)
    for x in range(n):
        want = [pass_memory(plan.programs(bwd)[x], shape, bwd) for bwd in (False, True)]
        assert peaks[x] == want, f"cp_rank {x}"
