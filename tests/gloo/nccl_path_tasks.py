"""Rank tasks for tests/gloo/test_nccl_path.py (see :mod:`tests.rank_pool`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist


@contextmanager
def recorded_batches() -> Iterator[list[list]]:
    """Every ``batch_isend_irecv`` posted on this rank inside the block, as its list of ops."""
    batches: list[list] = []
    real = dist.batch_isend_irecv

    def recording(ops):
        batches.append(list(ops))
        return real(ops)

    dist.batch_isend_irecv = recording
    try:
        yield batches
    finally:
        dist.batch_isend_irecv = real


def warm_up_contacts(ctx, ranks_per_node: int, timeout_s: float):
    """Build a topology while recording the warm-up's exchanges.

    Returns this rank's cp_rank, the ``(channel, peer cp_rank, send)`` ops the build posted, and
    the timeout of every channel group as the groups report it.
    """
    import megatron_charm as mc

    with recorded_batches() as batches:
        topo = mc.CPTopology.build(
            None, ranks_per_node=ranks_per_node, timeout=timedelta(seconds=timeout_s)
        )
    # (id of the group, global peer, send)
    posted = [(id(op.group), op.peer, op.op is dist.isend) for batch in batches for op in batch]
    names: dict[int, str] = {}
    for name in sorted(topo.channels):
        group = topo.channels[name]
        if group is not None:
            names.setdefault(id(group), name)  # an alias shares the first name's group
    cp_of = {g: x for x, g in enumerate(topo.global_ranks)}
    ops = sorted((names[g], cp_of[peer], send) for g, peer, send in posted)
    timeouts = {
        name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for name, group in topo.channels.items()
        if group is not None
    }
    return topo.cp_rank, ops, timeouts


def groups_on_nodes(ctx):
    """``CPTopology.build``'s count of the CP groups on each node (Note [Groups sharing a
    node]), on 4 ranks: two CP groups interleaved over two node identities, as TP 2 places them
    (global ranks 0, 1 on ``n0`` and 2, 3 on ``n1``; CP groups [0, 2] and [1, 3]), then the
    whole job as one CP group on one host that emulates its nodes (``ranks_per_node=2``).

    ``method="auto"`` on the interleaved group chooses with its count.

    Returns ``(layout of the interleaved group, its groups_per_node, the whole job's, the
    groups_per_node of auto's choices made here)``."""
    import megatron_charm as mc
    from megatron_charm.auto import _CACHE

    r = ctx.global_rank
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both, in order
    interleaved = mc.CPTopology.build(pairs[r % 2], node_id="n0" if r < 2 else "n1")
    whole = mc.CPTopology.build(None, ranks_per_node=2)
    _CACHE.clear()
    q = torch.randn(1, 8, 2, 8)
    mc.cp_attention(q, q, q, interleaved, method="auto", profile="H100", causal=True)
    counts = sorted({choice.groups_per_node for _, choice in _CACHE.values()})
    assert interleaved.describe().endswith(", 2 CP groups per node"), interleaved.describe()
    assert "CP groups per node" not in whole.describe()
    return interleaved.layout, interleaved.groups_per_node, whole.groups_per_node, counts


def _kv_deliveries_used(program) -> int:
    """Distinct (kv owner, delivery) pairs that the program's computes read (each Wait that
    brings a kv starts a new delivery)."""
    from megatron_charm.plan.types import Compute, Exchange, Kind, Wait

    delivery: dict[int, int] = {}
    recv: dict[int, list[int]] = {}
    used = set()
    for ins in program.instrs:
        if isinstance(ins, Exchange):
            recv[ins.handle] = [
                o.payload.owner for o in ins.ops if not o.send and o.payload.kind == Kind.KV
            ]
        elif isinstance(ins, Wait):
            for owner in recv.get(ins.handle, []):
                delivery[owner] = delivery.get(owner, 0) + 1
        elif isinstance(ins, Compute):
            used.add((ins.kv_owner, delivery.get(ins.kv_owner, 0)))
    return len(used)


def _counting(math, native: bool, real_expand):
    """The math kernel flagged with ``native`` GQA, recording the kv heads of every call, and
    an expansion function that counts its calls."""
    import dataclasses

    heads: list[int] = []
    expansions = [0]

    def counted(t, heads_wanted):
        expansions[0] += 1
        return real_expand(t, heads_wanted)

    def fwd_fn(q, k, v, causal, scale):
        heads.append(k.shape[2])
        return math.forward(q, k, v, causal, scale)

    def bwd_fn(dout, q, k, v, out, lse, causal, scale):
        heads.append(k.shape[2])
        return math.backward(dout, q, k, v, out, lse, causal, scale)

    kern = dataclasses.replace(
        math, forward=fwd_fn, backward=bwd_fn, native_gqa=lambda dev, dt: native
    )
    return kern, heads, expansions, counted


def gqa_expansions(ctx, method: str, ranks_per_node: int, h: int, h_kv: int):
    """Run one forward and backward pass with the float64 math kernel flagged without native
    GQA (the runner must expand) and with native GQA (it must not), counting expansions and the
    kv heads every kernel call sees.

    Returns, per flag: expansions per pass, the distinct kv deliveries the programs compute
    with, the kv head counts the kernel saw, peak buffer bytes per pass, and the results.
    """
    from megatron_charm.comm import executor
    from megatron_charm.function import backward_pass, forward_pass, validated_plan
    from megatron_charm.kernels import select_kernel
    from megatron_charm.plan import AttnShape, PlanOptions
    from megatron_charm.plan.keep import kept_pieces

    topo = ctx.topology(ranks_per_node)
    g = torch.Generator().manual_seed(7 + topo.cp_rank)
    s, b, d = 8, 1, 4
    q, dout = (torch.randn(s, b, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(s, b, h_kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    shape = AttnShape(b, s, h, h_kv, d, 8)
    plan = validated_plan(PlanOptions(method=method), topo.layout, True, shape)
    fwd, bwd = plan.forward[topo.cp_rank], plan.backward[topo.cp_rank]
    math = select_kernel(torch.device("cpu"), torch.float64, "math")
    real_expand = executor.expand_kv_heads
    answers = {}
    for native in (False, True):
        kern, heads, expansions, counted = _counting(math, native, real_expand)
        executor.expand_kv_heads = counted
        trace: list = []
        try:
            keep = kept_pieces(bwd)
            out, lse, kept = forward_pass(topo, fwd, q, k, v, kern, d**-0.5, trace, keep=keep)
            per_pass = [expansions[0]]
            grads = backward_pass(
                topo, bwd, q, k, v, out, lse, dout, kern, d**-0.5, trace, kept=kept
            )
            per_pass.append(expansions[0] - per_pass[0])
        finally:
            executor.expand_kv_heads = real_expand
        answers[native] = {
            "expansions": per_pass,
            "deliveries": [_kv_deliveries_used(fwd), _kv_deliveries_used(bwd)],
            "heads": sorted(set(heads)),
            "peak": [t.stats.peak_buffer_bytes for t in trace],
            "results": [out, *grads],
        }
    return answers


def _small_causal_pass(topo, method: str, seed: int, h_kv: int = 4) -> tuple:
    """``(q, k, v, dout, forward program, backward program, kernel, d)`` of a small causal
    float64 problem of ``method`` on ``topo``'s rank, 4 query heads over ``h_kv`` kv heads."""
    from megatron_charm.function import validated_plan
    from megatron_charm.kernels import select_kernel
    from megatron_charm.plan import AttnShape, PlanOptions

    g = torch.Generator().manual_seed(seed + topo.cp_rank)
    s, b, h, d = 8, 1, 4, 4
    q, dout = (torch.randn(s, b, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(s, b, h_kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    plan = validated_plan(
        PlanOptions(method=method), topo.layout, True, AttnShape(b, s, h, h_kv, d, 8)
    )
    fwd, bwd = plan.forward[topo.cp_rank], plan.backward[topo.cp_rank]
    kern = select_kernel(torch.device("cpu"), torch.float64, "math")
    return q, k, v, dout, fwd, bwd, kern, d


def exchange_post_order(ctx, method: str, ranks_per_node: int):
    """Run one forward and backward pass of ``method`` while recording, for every
    ``batch_isend_irecv`` the executor posts, whether each of its ops is a send, in order."""
    from megatron_charm.function import backward_pass, forward_pass
    from megatron_charm.plan.keep import kept_pieces

    topo = ctx.topology(ranks_per_node)
    q, k, v, dout, fwd, bwd, kern, d = _small_causal_pass(topo, method, 11)
    with recorded_batches() as batches:
        out, lse, kept = forward_pass(topo, fwd, q, k, v, kern, d**-0.5, [], keep=kept_pieces(bwd))
        backward_pass(topo, bwd, q, k, v, out, lse, dout, kern, d**-0.5, [], kept=kept)
    return [[op.op is dist.isend for op in batch] for batch in batches]


def _exchange_runs(program) -> list[int]:
    """Lengths of the runs of exchanges that ``program`` posts back to back, in order."""
    from megatron_charm.plan.types import Exchange

    grouped = itertools.groupby(program.instrs, key=lambda ins: isinstance(ins, Exchange))
    return [len(list(run)) for posted, run in grouped if posted]


def run_post_orders(ctx, method: str, ranks_per_node: int, h_kv: int = 4):
    """One forward and backward pass of ``method`` posted in gloo's order (every receive of a
    run first) and in NCCL's (one batch per exchange), on the same gloo groups.

    Returns, per order, the posted batches (each op as ``(send, peer global rank, numel)``) and
    the pass's results, and the lengths of the runs of exchanges of both passes' programs."""
    import dataclasses

    from megatron_charm.function import backward_pass, forward_pass
    from megatron_charm.plan.keep import kept_pieces

    topo = ctx.topology(ranks_per_node)
    q, k, v, dout, fwd, bwd, kern, d = _small_causal_pass(topo, method, 29, h_kv)
    answers = {}
    # NCCL's order on gloo groups: the backend name is all that chooses it
    for name, t in (("gloo", topo), ("nccl", dataclasses.replace(topo, backend="nccl"))):
        assert t.receives_first_in_runs == (name == "gloo")
        with recorded_batches() as batches:
            out, lse, kept = forward_pass(t, fwd, q, k, v, kern, d**-0.5, keep=kept_pieces(bwd))
            grads = backward_pass(t, bwd, q, k, v, out, lse, dout, kern, d**-0.5, kept=kept)
        posted = [[(op.op is dist.isend, op.peer, op.tensor.numel()) for op in b] for b in batches]
        answers[name] = {"batches": posted, "results": [out, lse, *grads]}
    answers["runs"] = _exchange_runs(fwd) + _exchange_runs(bwd)
    return answers


def rebuilt_topologies(ctx, builds: int):
    """Build a topology ``builds`` times over the pool (2 nodes x 2), run a call on each and
    destroy it.

    Returns the process groups this rank holds and its open files after each round, the groups
    it held before the first, and the error of a call on the last, destroyed topology (after a
    second ``destroy``, which must do nothing)."""
    import os

    import megatron_charm as mc
    from megatron_charm.comm.topology import live_process_groups

    def held() -> int:
        return len(live_process_groups())

    q = torch.randn(1, 8, 2, 8)
    before, rounds = held(), []
    for _ in range(builds):
        topo = mc.CPTopology.build(None, ranks_per_node=2)
        mc.cp_attention(q, q, q, topo, method="charm")
        topo.destroy()
        rounds.append((held(), len(os.listdir("/proc/self/fd"))))
    topo.destroy()
    try:
        mc.cp_attention(q, q, q, topo, method="charm")
    except ValueError as exc:
        return before, rounds, str(exc)
    return before, rounds, None
