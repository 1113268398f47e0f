"""Functions that run on every rank of a worker pool (see :mod:`tests.rank_pool`)."""

from __future__ import annotations

import os
import time

import torch

from tests.gloo.reference import local_index, naive_attention


def _global_inputs(b, seq, h, h_kv, d, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(b, seq, heads, d, generator=g, dtype=torch.float64)  # noqa: E731
    return mk(h), mk(h_kv), mk(h_kv), mk(h)


def _grads_of(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    (out.to(torch.float64) * dout).sum().backward()
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


def compare_with_reference(
    ctx,
    method: str,
    ranks_per_node: int | None,
    variants: list[tuple[bool, int, str]],
    b: int = 2,
    s_local: int = 8,
    h: int = 4,
    d: int = 16,
    seed: int = 0,
    qkv_format: str = "bshd",
    options: dict | None = None,
):
    """Run ``method`` for each (causal, h_kv, dtype) variant; return per-variant max errors.

    For each of out, lse, dq, dk, dv: ``ours`` is the max abs error of cp_attention against the
    float64 reference; ``naive`` the same for a naive implementation in the input dtype.
    """
    topo = ctx.topology(ranks_per_node)
    return [
        _one_variant(
            topo,
            method,
            causal,
            h_kv,
            getattr(torch, dt),
            b,
            s_local,
            h,
            d,
            seed,
            qkv_format,
            options or {},
        )
        for causal, h_kv, dt in variants
    ]


def _one_variant(topo, method, causal, h_kv, dtype, b, s_local, h, d, seed, qkv_format, options):
    import megatron_charm as mc

    n, x = topo.cp_size, topo.cp_rank
    seq = s_local * n
    Q, K, V, DO = _global_inputs(b, seq, h, h_kv, d, seed)
    Q, K, V = (t.to(dtype).to(torch.float64) for t in (Q, K, V))  # same inputs for all
    scale = d**-0.5
    opts = mc.PlanOptions(method=method, **options)
    idx = local_index(x, n, seq, causal, opts.seq_layout)

    def ref(q, k, v, upcast):
        return naive_attention(q, k, v, causal, scale, upcast)

    want = _grads_of(lambda q, k, v: ref(q, k, v, True), Q, K, V, DO)
    low = [t.to(dtype) for t in (Q, K, V)]
    naive = _grads_of(lambda q, k, v: ref(q, k, v, False), *low, DO)

    def ours(q, k, v):
        if qkv_format == "sbhd":
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out, lse = mc.cp_attention(
            q,
            k,
            v,
            topo,
            method=method,
            causal=causal,
            qkv_format=qkv_format,
            return_lse=True,
            softmax_scale=scale,
            options=opts,
        )
        if qkv_format == "sbhd":
            out = out.transpose(0, 1)
        return out, lse

    got = _grads_of(ours, *(t[:, idx] for t in low), DO[:, idx])

    def local(t, i):
        return t[:, :, idx] if i == 1 else t[:, idx]

    errs, nerrs, mags = [], [], []
    for i in range(5):
        w = local(want[i], i).to(torch.float64)
        errs.append((got[i].to(torch.float64) - w).abs().max().item())
        nerrs.append((local(naive[i], i).to(torch.float64) - w).abs().max().item())
        mags.append(w.abs().max().item())
    return {
        "variant": (causal, h_kv, str(dtype).removeprefix("torch.")),
        "ours": errs,
        "naive": nerrs,
        "magnitude": mags,
        "finite": all(torch.isfinite(t).all().item() for t in got),
    }


def bytes_moved(
    ctx,
    method: str,
    ranks_per_node: int | None,
    causal: bool,
    b=1,
    s_local=8,
    h=4,
    h_kv=2,
    d=8,
    dtype="bfloat16",
):
    """Bytes this rank's executor sent per channel, forward and backward."""
    import megatron_charm as mc

    topo = ctx.topology(ranks_per_node)
    dt = getattr(torch, dtype)
    q = torch.randn(b, s_local, h, d, dtype=dt, requires_grad=True)
    k = torch.randn(b, s_local, h_kv, d, dtype=dt, requires_grad=True)
    v = torch.randn(b, s_local, h_kv, d, dtype=dt, requires_grad=True)
    traces: list = []
    out = mc.cp_attention(q, k, v, topo, method=method, causal=causal, trace=traces)
    out.sum().backward()
    return [dict(tr.stats.bytes_sent) for tr in traces]


def stand_in_calls(ctx, method: str, ranks_per_node: int | None) -> int:
    """How many blocks of this rank's backward built the stand-in for ``out`` from ``delta``
    (Note [The backward bundle]); blocks of the rank's own queries use the real ``out``."""
    import megatron_charm as mc
    from megatron_charm.comm import executor

    calls = 0
    real = executor.out_for_delta

    def counting(dout, delta):
        nonlocal calls
        calls += 1
        return real(dout, delta)

    topo = ctx.topology(ranks_per_node)
    q, k, v = (torch.randn(1, 8, 4, 8, requires_grad=True) for _ in range(3))
    executor.out_for_delta = counting
    try:
        mc.cp_attention(q, k, v, topo, method=method, causal=True).sum().backward()
    finally:
        executor.out_for_delta = real
    return calls


def link_profile(slow: bool):
    """A 2 x 2 profile on which ``auto`` picks charm (``slow`` cross links) or all_gather (fast
    ones) for 4 query heads over 2 kv heads (tests/sim/test_profile.py checks the choices)."""
    from megatron_charm.sim.profile import Profile

    return Profile(
        name="slow" if slow else "fast",
        measured=False,
        gpus="2x2",
        intra_bw=1.0,
        cross_bw=1e-6 if slow else 1e3,
        intra_lat=0.0,
        cross_lat=0.0,
        nics_per_node=1,
        fabric="nvlink",
        compute={"kind": "fitted", "fwd_flops_per_s": 1e9, "bwd_flops_per_s": 1e9},
    )


def auto_matches_its_choice(ctx):
    """``method="auto"`` runs exactly the method it picks: out and grads are bitwise those of
    that method called by name. Returns the picked method."""
    import megatron_charm as mc
    from megatron_charm.auto import choose_method
    from megatron_charm.plan.payloads import AttnShape

    topo = ctx.topology(2)
    g = torch.Generator().manual_seed(ctx.global_rank)
    q, k, v, dout = (torch.randn(1, 8, hh, 8, generator=g) for hh in (4, 2, 2, 4))
    prof = link_profile(slow=True)
    picked = choose_method(prof, topo.layout, AttnShape(1, 8, 4, 2, 8, 4), True).method

    def run(**kw):
        return _grads_of(
            lambda a, b, c: mc.cp_attention(a, b, c, topo, return_lse=True, **kw), q, k, v, dout
        )

    auto, named = run(method="auto", profile=prof), run(method=picked)
    assert all(torch.equal(a, b) for a, b in zip(auto, named, strict=True))
    return picked


def one_rank_planning_matches(ctx):
    """Above ``FULL_CHECK_MAX_CP`` every rank plans and checks only itself (Note [Planning one
    rank]): causal GQA charm on 2 x 2 gives bitwise the outputs and gradients of the fully
    replayed plan. Returns whether the one-rank path ran."""
    import megatron_charm as mc
    import megatron_charm.function as fn

    topo = ctx.topology(2)
    g = torch.Generator().manual_seed(ctx.global_rank)
    q, k, v, dout = (torch.randn(1, 8, hh, 8, generator=g) for hh in (4, 2, 2, 4))

    def run():
        return _grads_of(
            lambda a, b, c: mc.cp_attention(a, b, c, topo, method="charm", return_lse=True),
            q,
            k,
            v,
            dout,
        )

    full = run()
    before, fn.FULL_CHECK_MAX_CP = fn.FULL_CHECK_MAX_CP, 1
    try:
        misses = fn._checked_rank.cache_info().misses
        one = run()
        used = fn._checked_rank.cache_info().misses > misses
    finally:
        fn.FULL_CHECK_MAX_CP = before
    assert all(torch.equal(a, b) for a, b in zip(full, one, strict=True))
    return used


def expect_value_error(ctx, case: str):
    """Trigger a bad-input case on every rank; return the ValueError message (or None)."""
    import megatron_charm as mc

    topo = ctx.topology(None)
    r = ctx.global_rank
    t = lambda *shape, dtype=torch.float32: torch.randn(*shape, dtype=dtype)  # noqa: E731
    q, k, v = t(1, 8, 4, 8), t(1, 8, 2, 8), t(1, 8, 2, 8)
    try:
        if case == "odd_causal":
            mc.cp_attention(t(1, 7, 4, 8), t(1, 7, 4, 8), t(1, 7, 4, 8), topo)
        elif case == "lengths_differ":
            s = 8 if r == 0 else 12
            mc.cp_attention(t(1, s, 4, 8), t(1, s, 4, 8), t(1, s, 4, 8), topo, method="rm+")
        elif case == "methods_differ":
            mc.cp_attention(q, k, v, topo, method="ring" if r == 0 else "charm")
        elif case == "options_differ":
            ret = "input" if r == 0 else "fp32"
            mc.cp_attention(q, k, v, topo, options=mc.PlanOptions(cross_return=ret))
        elif case == "shape_changes_later":
            # a good first call, then one rank changes its local length: caught at that call
            mc.cp_attention(q, k, v, topo)
            s = 8 if r == 0 else 12
            mc.cp_attention(t(1, s, 4, 8), t(1, s, 2, 8), t(1, s, 2, 8), topo)
        elif case == "empty":
            mc.cp_attention(t(1, 0, 4, 8), t(1, 0, 2, 8), t(1, 0, 2, 8), topo)
        elif case == "overlapping_calls":
            # another thread is inside a call on this topology (held lock stands for it)
            with topo.exclusive():
                mc.cp_attention(q, k, v, topo)
        elif case == "heads":
            mc.cp_attention(t(1, 8, 4, 8), t(1, 8, 3, 8), t(1, 8, 3, 8), topo)
        elif case == "dtype":
            mc.cp_attention(q, k.to(torch.bfloat16), v, topo)
        elif case == "head_dim":
            mc.cp_attention(q, t(1, 8, 2, 16), t(1, 8, 2, 16), topo)
        elif case == "kv_shapes":
            mc.cp_attention(q, k, t(1, 8, 1, 8), topo)
        elif case == "method":
            mc.cp_attention(q, k, v, topo, method="ulysses")
        elif case == "a2a_heads":  # 2 kv heads cannot split over 4 ranks
            mc.cp_attention(q, k, v, topo, method="a2a")
        elif case == "a2a_p2p_heads":  # 2 kv heads cannot split over a node of 4
            mc.cp_attention(q, k, v, topo, method="a2a+p2p")
        elif case == "masks_differ":
            docs = (16, 16) if r == 0 else (8, 24)
            mc.cp_attention(q, k, v, topo, mask=mc.DocMask(docs))
        elif case == "mask_total":
            mc.cp_attention(q, k, v, topo, mask=mc.DocMask((10,)))
        elif case == "mask_ring_contig":
            mc.cp_attention(q, k, v, topo, method="ring-contig", mask=mc.DocMask((32,)))
        elif case == "mask_thd_lengths":
            mc.cp_attention(q, k, v, topo, mask=mc.DocMask((12, 20), "thd"))
        elif case == "mask_window":
            mc.cp_attention(q, k, v, topo, mask=mc.DocMask((32,), window=(-3, 0)))
        elif case == "auto_no_profile":
            mc.cp_attention(q, k, v, topo, method="auto")
        elif case == "profile_not_auto":
            mc.cp_attention(q, k, v, topo, method="charm", profile="H100")
        elif case == "auto_profiles_differ":  # each rank predicts on its own (different) profile
            slow = r != 0
            mc.cp_attention(q, k, v, ctx.topology(2), method="auto", profile=link_profile(slow))
        elif case == "format":
            mc.cp_attention(q, k, v, topo, qkv_format="thd")
        elif case == "device":
            m = lambda x: x.to("meta")  # noqa: E731
            mc.cp_attention(m(q), m(k), m(v), topo)
        elif case == "rpn_disagree":
            mc.CPTopology.build(None, ranks_per_node=2 if r == 0 else 4)
        elif case == "rpn_divide":
            mc.CPTopology.build(None, ranks_per_node=3)
        elif case == "unequal_nodes":
            mc.CPTopology.build(None, node_id="a" if r < 2 else "b")
        else:
            raise AssertionError(case)
    except ValueError as exc:
        return str(exc)
    return None


def dead_rank(ctx, timeout_s: float = 5.0):
    """Rank 1 dies; rank 0 must get an error, not hang. Returns (exception name, seconds)."""
    import megatron_charm as mc

    topo = ctx.topology(None, timeout_s=timeout_s)
    q = torch.randn(1, 8, 2, 8)
    if ctx.global_rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        mc.cp_attention(q, q, q, topo, method="charm")
    except Exception as exc:  # noqa: BLE001 - the test inspects the type
        return type(exc).__name__, time.monotonic() - start, str(exc)[:300]
    return None, time.monotonic() - start, ""


def peak_bytes(
    ctx, method: str, ranks_per_node: int | None, causal: bool, options=None, s_local: int = 8
):
    """This rank's executor ``peak_buffer_bytes`` of the forward and of the backward (sbhd
    bf16 inputs, 8 query heads over 4 kv heads)."""
    import megatron_charm as mc
    from megatron_charm.plan import PlanOptions

    topo = ctx.topology(ranks_per_node)
    b, h, h_kv, d = 2, 8, 4, 8
    gen = torch.Generator().manual_seed(topo.cp_rank)
    q, k, v = (
        torch.randn(s_local, b, n, d, generator=gen).to(torch.bfloat16).requires_grad_()
        for n in (h, h_kv, h_kv)
    )
    plan_options = PlanOptions(method=method, **(options or {}))
    traces: list = []
    out = mc.cp_attention(
        q, k, v, topo, causal=causal, qkv_format="sbhd", trace=traces, options=plan_options
    )
    out.float().sum().backward()
    return [tr.stats.peak_buffer_bytes for tr in traces]


def backward_twice(ctx, foreign_q: str):
    """Run cp_attention's backward twice on one forward (``retain_graph``); the second
    backward's error message, or ``None`` when it ran."""
    import megatron_charm as mc
    from megatron_charm.plan import PlanOptions

    topo = ctx.topology(2)
    gen = torch.Generator().manual_seed(topo.cp_rank)
    q, k, v = (torch.randn(1, 8, 4, 8, generator=gen).requires_grad_() for _ in range(3))
    out = mc.cp_attention(q, k, v, topo, options=PlanOptions(foreign_q=foreign_q))
    out.sum().backward(retain_graph=True)
    try:
        out.sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def agreement_on_control_group(ctx):
    """The call agreement runs on the topology's own gloo group: a call succeeds, and a
    mismatch still raises, with the CP group itself made unusable (Note [Call agreement])."""
    import dataclasses

    import torch.distributed as dist

    import megatron_charm as mc

    topo = ctx.topology(2)
    control = topo.control
    facts = {
        "backend": str(dist.get_backend(control)) if control is not None else None,
        "ranks": dist.get_process_group_ranks(control) if control is not None else None,
        "separate": control is not None and control is not topo.cp_group,
    }
    cut = dataclasses.replace(topo, cp_group=object())  # any collective on it fails
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, 4, 8, generator=g) for _ in range(3))
    facts["out_shape"] = tuple(mc.cp_attention(q, k, v, cut).shape)
    s = 8 if ctx.global_rank == 0 else 12
    try:
        mc.cp_attention(*(torch.randn(1, s, 4, 8) for _ in range(3)), cut)
        facts["mismatch"] = None
    except ValueError as err:
        facts["mismatch"] = str(err)
    return facts


def derived_once(ctx):
    """Two forward+backward calls of one shape: the runner derives each program's steps and
    release points at the first call only (Note [Derived once]), and the two calls agree."""
    import megatron_charm as mc
    from megatron_charm.comm import derived

    topo = ctx.topology(2)
    gen = torch.Generator().manual_seed(topo.cp_rank)
    q, k, v = (torch.randn(1, 8, 4, 8, generator=gen) for _ in range(3))
    derived.clear()
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mc.cp_attention(*leaves, topo, method="charm")
        out.sum().backward()
        grads.append([out.detach(), *(t.grad for t in leaves)])
    info = derived._pass_steps.cache_info()
    same = all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    return info.misses, info.hits, derived._kept_by.cache_info().misses, same
