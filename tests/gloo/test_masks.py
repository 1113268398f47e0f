"""Document masks and sliding windows: every method against a float64 reference that applies the
same mask to the gathered sequence (gloo, CPU ranks). Tolerances as test_cp_attention, with a
floor of ``eps * 1e-4`` for gradients that are exactly zero (a query with one allowed key)."""

from __future__ import annotations

import pytest

from tests.gloo import mask_tasks
from tests.gloo.reference import error_bound

NAMES = ["out", "lse", "dq", "dk", "dv"]


def _cases(seed0: int, h_kv_choices=(4, 2, 1)):
    """(seed, layout, causal, window, h_kv, dtype): both layouts, causal and full, windows, GQA
    and MQA, float32 and bfloat16."""
    out = []
    i = 0
    for layout in ("bshd", "thd"):
        for causal in (True, False):
            for window in (False, True):
                h_kv = h_kv_choices[i % len(h_kv_choices)]
                dtype = ("float32", "bfloat16")[i % 2]
                out.append((seed0 + i, layout, causal, window, h_kv, dtype))
                i += 1
    return out


def check(results):
    for res in results:
        *_, dtype = res["case"]
        assert res["finite"], f"non-finite output/gradient for {res['case']} {res['mask']}"
        for name, ours, naive, mag in zip(
            NAMES, res["ours"], res["naive"], res["magnitude"], strict=True
        ):
            # the floor: a window of 0 leaves one key per query, whose exact dq is 0
            bound = error_bound(dtype, naive, mag, floor=1e-4)
            assert ours <= bound, (
                f"{name} error {ours:.3e} > {bound:.3e} (naive {naive:.3e}) for {res['case']} "
                f"{res['mask']}"
            )


METHOD_CASES = [
    (4, "charm", 2),
    (4, "charm", 1),
    (2, "charm", 1),
    (4, "ring", 4),
    (4, "rm+", 4),
    (4, "merge", 4),
    (4, "all_gather", 4),
    (4, "a2a", 4),
    (4, "a2a+p2p", 2),
    (4, "a2a+charm", 2),
    (8, "charm", 4),
]


@pytest.mark.gloo
@pytest.mark.parametrize(
    "n,method,p", METHOD_CASES, ids=[f"n{n}-{m}-{n // p}x{p}" for n, m, p in METHOD_CASES]
)
def test_masked_matches_reference(pools, n, method, p):
    h_kv = (4,) if method == "a2a" else (4, 2, 1)
    if method in ("a2a+p2p", "a2a+charm"):  # kv heads split over the node's 2 ranks
        h_kv = (4, 2)
    cases = _cases(100 * n + len(method), h_kv)
    results = pools(n).run(mask_tasks.compare_masked, method=method, ranks_per_node=p, cases=cases)
    for rank_results in results:
        check(rank_results)


@pytest.mark.gloo
def test_documents_within_chunks_move_nothing(pools):
    """Documents no longer than a zigzag chunk, aligned to chunks: every block but the diagonal is
    empty, so no rank sends a byte, and the result is still exact."""
    import megatron_charm as mc

    mask = mc.DocMask((8,) * 8)  # 64 tokens: 8 zigzag chunks of 8 on 4 ranks, one per document
    results = pools(4).run(
        mask_tasks.compare_fixed_mask, method="charm", ranks_per_node=2, mask=mask
    )
    for res in results:
        check([res])
        assert res["bytes"] == [0, 0], res["bytes"]
