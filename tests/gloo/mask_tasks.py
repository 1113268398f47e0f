"""Rank functions for document masks: cp_attention with a ``DocMask`` against a float64 reference
that applies the same mask to the gathered sequence (see :mod:`tests.rank_pool`)."""

from __future__ import annotations

import random

import torch

from megatron_charm.plan.layout import zigzag_positions
from tests.gloo.reference import naive_attention
from tests.gloo.tasks import _grads_of


def random_mask(seed: int, cp_size: int, s_local: int, layout: str, window: bool, causal: bool):
    """A random DocMask covering ``cp_size * s_local`` tokens: documents shorter than a chunk,
    documents that cross every rank boundary, and (``thd``) padding."""
    import megatron_charm as mc

    rng = random.Random(seed)
    total = cp_size * s_local
    win = None
    if window:
        win = (rng.randint(0, total // 3), -1 if causal else rng.randint(0, total // 4))
    if layout == "bshd":
        cuts = sorted(rng.sample(range(1, total), rng.randint(1, min(8, total - 1))))
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        return mc.DocMask(tuple(lens), "bshd", window=win)
    unit, padded = 2 * cp_size, []
    left = total // unit
    while left:
        take = rng.randint(1, left)
        padded.append(take * unit)
        left -= take
    real = [rng.randint(1, p) for p in padded]
    return mc.DocMask(tuple(padded), "thd", tuple(real), win)


def token_table(mask, cp_size: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """``(doc, pos)`` of every global token, and each cp_rank's global indices in local order."""
    if mask.layout == "bshd":
        table = [(d, p) for d, n in enumerate(mask.seq_lens) for p in range(n)]
        return table, [zigzag_positions(r, cp_size, len(table)) for r in range(cp_size)]
    real = mask.real_lens or mask.seq_lens
    pad = len(mask.seq_lens)
    table, starts = [], []
    for i, n in enumerate(mask.seq_lens):
        starts.append(len(table))
        table += [(i, p) if p < real[i] else (pad + i, p - real[i]) for p in range(n)]
    local = []
    for r in range(cp_size):
        idx = []
        for i, n in enumerate(mask.seq_lens):
            c = n // (2 * cp_size)
            for chunk in (r, 2 * cp_size - 1 - r):
                idx += range(starts[i] + chunk * c, starts[i] + (chunk + 1) * c)
        local.append(idx)
    return table, local


def allowed_matrix(mask, table, causal: bool) -> torch.Tensor:
    """``[S, S]`` bool: query i may attend key j."""
    lo, hi = float("-inf"), (0 if causal else float("inf"))
    if mask.window is not None:
        left, right = mask.window
        lo = lo if left == -1 else -left
        hi = hi if right == -1 else min(hi, right)
    doc = torch.tensor([d for d, _ in table])
    pos = torch.tensor([p for _, p in table], dtype=torch.float64)
    delta = pos.unsqueeze(0) - pos.unsqueeze(1)
    return (doc.unsqueeze(0) == doc.unsqueeze(1)) & (delta >= lo) & (delta <= hi)


def compare_masked(
    ctx,
    method: str,
    ranks_per_node: int,
    cases: list[tuple[int, str, bool, bool, int, str]],
    b: int = 1,
    s_local: int = 16,
    h: int = 4,
    d: int = 16,
    trace: bool = False,
    masks: list | None = None,
):
    """For each ``(seed, layout, causal, window, h_kv, dtype)``: max errors of out, lse, dq, dk,
    dv against the float64 reference, a naive same-dtype implementation's, and (``trace``) the
    bytes each pass sent. ``masks``: one given mask per case instead of a random one."""
    topo = ctx.topology(ranks_per_node)
    n = topo.cp_size
    results = []
    for i, (seed, layout, causal, window, h_kv, dtype_name) in enumerate(cases):
        if masks is not None:
            mask = masks[i]
        else:
            mask = random_mask(seed, n, s_local, layout, window, causal)
        dims = (b, s_local, h, d)
        res = _one_case(topo, method, mask, causal, h_kv, dtype_name, dims, seed, trace)
        res["case"] = (seed, layout, causal, window, h_kv, dtype_name)
        results.append(res)
    return results


def _one_case(topo, method, mask, causal, h_kv, dtype_name, dims, seed, trace):
    import megatron_charm as mc

    b, s_local, h, d = dims
    n, x = topo.cp_size, topo.cp_rank
    dtype = getattr(torch, dtype_name)
    table, local = token_table(mask, n)
    allowed = allowed_matrix(mask, table, causal)
    g = torch.Generator().manual_seed(seed)
    Q, K, V, DO = (
        torch.randn(b, n * s_local, heads, d, generator=g, dtype=torch.float64)
        for heads in (h, h_kv, h_kv, h)
    )
    Q, K, V = (t.to(dtype).to(torch.float64) for t in (Q, K, V))
    scale = d**-0.5

    def ref(upcast):
        return lambda q, k, v: naive_attention(q, k, v, False, scale, upcast, allowed)

    want = _grads_of(ref(True), Q, K, V, DO)
    low = [t.to(dtype) for t in (Q, K, V)]
    naive = _grads_of(ref(False), *low, DO)
    idx = torch.tensor(local[x])
    runs: list = []

    def ours(q, k, v):
        return mc.cp_attention(
            q,
            k,
            v,
            topo,
            method=method,
            causal=causal,
            return_lse=True,
            softmax_scale=scale,
            mask=mask,
            trace=runs if trace else None,
        )

    got = _grads_of(ours, *(t[:, idx] for t in low), DO[:, idx])
    errs, nerrs, mags = [], [], []
    for i in range(5):
        w = (want[i][:, :, idx] if i == 1 else want[i][:, idx]).to(torch.float64)
        nv = naive[i][:, :, idx] if i == 1 else naive[i][:, idx]
        errs.append((got[i].to(torch.float64) - w).abs().max().item())
        nerrs.append((nv.to(torch.float64) - w).abs().max().item())
        mags.append(w.abs().max().item())
    return {
        "mask": mask,
        "ours": errs,
        "naive": nerrs,
        "magnitude": mags,
        "finite": all(torch.isfinite(t).all().item() for t in got),
        "bytes": [sum(r.stats.bytes_sent.values()) for r in runs] if trace else None,
    }


def compare_fixed_mask(ctx, method: str, ranks_per_node: int, mask, causal: bool = True):
    """:func:`compare_masked` for one given mask (float32, GQA 2:1), with bytes sent."""
    n = ctx.topology(ranks_per_node).cp_size
    case = (0, mask.layout, causal, mask.window is not None, 2, "float32")
    (res,) = compare_masked(
        ctx, method, ranks_per_node, [case], s_local=mask.total // n, trace=True, masks=[mask]
    )
    return res
