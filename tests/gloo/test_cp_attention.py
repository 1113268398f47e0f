"""cp_attention against a float64 reference on the gathered sequence (gloo, CPU ranks).

Tolerances: float32 within 1e-4 relative to the reference's magnitude. Low precision: twice the
error of a naive implementation in the same dtype (flash-attn's rule), plus one rounding of the
largest value (``eps * max|ref|``): every CP method, ring included, receives each block's partial
result from the kernel already rounded to the input dtype and rounds the merged sum once more, and a
naive single-process implementation rounds only once.
"""

from __future__ import annotations

import pytest

from tests.gloo import tasks
from tests.gloo.reference import error_bound

VARIANTS = [
    (causal, h_kv, dtype)
    for causal in (True, False)
    for h_kv in (4, 2)  # MHA (h = 4) and GQA
    for dtype in ("float32", "bfloat16")
]
NAMES = ["out", "lse", "dq", "dk", "dv"]

# (cp_size, ranks_per_node): charm on every node split; the flat methods once per size.
LAYOUTS = {2: [2, 1], 3: [3, 1], 4: [4, 2, 1], 6: [6, 2], 8: [8, 4, 1]}
CASES = []
for n, splits in LAYOUTS.items():
    for method in ("ring", "merge", "rm+"):
        CASES.append((n, method, n))
    for p in splits:
        CASES.append((n, "charm", p))
    if n <= 4:  # all-gather has no node structure and no levels: small groups cover it
        CASES.append((n, "all_gather", n))
        CASES.append((n, "ring-contig", n))  # on contiguous shards (tests.gloo.reference)
    if n == 4:  # a2a inside nodes of 2 (h = 4 and h_kv = 2 split over 2), ring across nodes
        CASES.append((n, "a2a+p2p", 2))
    if n in (2, 4, 6):  # a2a inside nodes of 1 or 2, queries across 2 or 3 nodes
        CASES.append((n, "a2a+charm", 1 if n == 2 else 2))
    if n != 8:
        CASES.append((n, "tasp", n))

# TASP cuts each zigzag half of a rank's kv into n - 1 chunks (Note [TASP schedule])
TASP_S_LOCAL = {2: 8, 3: 8, 4: 12, 6: 20}


def check(results):
    for res in results:
        causal, h_kv, dtype = res["variant"]
        assert res["finite"], f"non-finite output/gradient for {res['variant']}"
        for name, ours, naive, mag in zip(
            NAMES, res["ours"], res["naive"], res["magnitude"], strict=True
        ):
            bound = error_bound(dtype, naive, mag)
            assert ours <= bound, (
                f"{name} error {ours:.3e} > {bound:.3e} (naive {naive:.3e}) for causal={causal} "
                f"h_kv={h_kv} {dtype}"
            )


@pytest.mark.gloo
@pytest.mark.parametrize("n,method,p", CASES, ids=[f"n{n}-{m}-{n // p}x{p}" for n, m, p in CASES])
def test_matches_reference(pools, n, method, p):
    s_local = TASP_S_LOCAL[n] if method == "tasp" else 8
    results = pools(n).run(
        tasks.compare_with_reference,
        method=method,
        ranks_per_node=p,
        variants=VARIANTS,
        s_local=s_local,
    )
    for rank_results in results:
        check(rank_results)


@pytest.mark.gloo
@pytest.mark.parametrize("n,h_kv", [(2, 2), (4, 4)], ids=["n2-gqa", "n4-mha"])
def test_a2a_matches_reference(pools, n, h_kv):
    """Ulysses splits the heads over the group: h = 4 with GQA on two ranks, MHA on four."""
    variants = [(c, h_kv, dt) for c in (True, False) for dt in ("float32", "bfloat16")]
    results = pools(n).run(
        tasks.compare_with_reference, method="a2a", ranks_per_node=n, variants=variants
    )
    for rank_results in results:
        check(rank_results)


@pytest.mark.gloo
@pytest.mark.parametrize("method", ["charm", "ring"])
def test_sbhd_format(pools, method):
    results = pools(4).run(
        tasks.compare_with_reference,
        method=method,
        ranks_per_node=2,
        variants=[(True, 2, "float32")],
        qkv_format="sbhd",
    )
    for rank_results in results:
        check(rank_results)


@pytest.mark.gloo
def test_float16(pools):
    results = pools(4).run(
        tasks.compare_with_reference,
        method="charm",
        ranks_per_node=2,
        variants=[(True, 2, "float16"), (False, 4, "float16")],
    )
    for rank_results in results:
        check(rank_results)


@pytest.mark.gloo
@pytest.mark.parametrize("n,p", [(4, 2), (8, 4), (8, 2)])
def test_charm_combined_nodes(pools, n, p):
    """The paper's Algorithm 2 (queries cross whole, one step a source node, the first with the
    own q: Note [Algorithm 2 per step]), on 2 and 4 nodes."""
    results = pools(n).run(
        tasks.compare_with_reference,
        method="charm",
        ranks_per_node=p,
        variants=VARIANTS,
        options={"combine_nodes": True},
    )
    for rank_results in results:
        check(rank_results)


@pytest.mark.gloo
def test_charm_input_dtype_cross_returns(pools):
    """Node-merged results crossing back in the input dtype stay within the low-precision bound."""
    results = pools(4).run(
        tasks.compare_with_reference,
        method="charm",
        ranks_per_node=2,
        variants=VARIANTS,
        options={"cross_return": "input"},
    )
    for rank_results in results:
        check(rank_results)


GQA_VARIANTS = [
    (causal, h_kv, dtype)
    for causal in (True, False)
    for h_kv in (2, 1)  # 4:1 and 8:1 (MQA) over h = 8
    for dtype in ("float32", "bfloat16")
]


@pytest.mark.gloo
@pytest.mark.parametrize("cross_level", ["q", "kv", "auto"])
@pytest.mark.parametrize("n,p", [(4, 2), (6, 2), (8, 4)])
def test_charm_cross_levels_gqa(pools, cross_level, n, p):
    """kv crossing nodes (the GQA dual of CHARM+) is exact forward and backward, like q."""
    results = pools(n).run(
        tasks.compare_with_reference,
        method="charm",
        ranks_per_node=p,
        variants=GQA_VARIANTS,
        h=8,
        options={"cross_level": cross_level},
    )
    for rank_results in results:
        check(rank_results)


@pytest.mark.gloo
@pytest.mark.parametrize("foreign_q", ["keep", "resend"])
@pytest.mark.parametrize("n,p", [(4, 2), (6, 2), (8, 4), (4, 1)])
def test_charm_foreign_q(pools, foreign_q, n, p):
    """Note [Keeping foreign queries]: a backward that completes the bundles with the forward's
    kept q pieces is exact, like one that ships q again."""
    results = pools(n).run(
        tasks.compare_with_reference,
        method="charm",
        ranks_per_node=p,
        variants=VARIANTS,
        options={"cross_level": "q", "foreign_q": foreign_q},
    )
    for rank_results in results:
        check(rank_results)


@pytest.mark.gloo
def test_a_second_backward_with_kept_queries_is_refused_clearly(pools):
    """The kept pieces serve one backward; a second one (retain_graph) says which option to
    change, on every rank and before any exchange, and resending runs it."""
    kept = pools(4).run(tasks.backward_twice, foreign_q="keep")
    assert all(msg is not None and "foreign_q='resend'" in msg for msg in kept), kept
    assert pools(4).run(tasks.backward_twice, foreign_q="resend") == [None] * 4


@pytest.mark.gloo
def test_own_blocks_use_the_real_out(pools):
    """Ring's backward computes only the rank's own queries, so no block builds the stand-in for
    out (Note [The backward bundle]); CHARM+'s foreign queries do."""
    assert pools(4).run(tasks.stand_in_calls, method="ring", ranks_per_node=2) == [0] * 4
    assert all(n > 0 for n in pools(4).run(tasks.stand_in_calls, method="charm", ranks_per_node=2))


@pytest.mark.gloo
def test_a_layer_shape_derives_its_programs_steps_once(pools) -> None:
    """Note [Derived once]: the second call of a shape reuses the first call's steps and
    release points for its forward and backward programs, and computes the same."""
    for misses, hits, kept_misses, same in pools(4).run(tasks.derived_once):
        assert (misses, hits, kept_misses) == (2, 2, 1)
        assert same
