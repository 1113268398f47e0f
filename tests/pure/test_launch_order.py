"""Note [Launch order]: on CUDA an exchange overlaps only the computes posted after it (PyTorch
makes a transfer wait for the work already queued on the current stream, and with
``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream shares one hardware queue). So, as Transformer
Engine posts step 1's transfer before step 0's attention, every plan posts the input exchanges of
its first round that it can post (ready and within the window) before its first block."""

from __future__ import annotations

import pytest

from megatron_charm.plan import METHODS, Layout, PlanOptions, build_plan
from megatron_charm.plan.keep import held_input
from megatron_charm.plan.types import Compute, Exchange, Kind, Merge, Program, Wait

SPLITS = [(n, p) for n in range(2, 13) for p in range(1, n + 1) if n % p == 0]


def ready_points(prog: Program, backward: bool) -> list[tuple[int, int, Exchange]]:
    """``(index, ready index, exchange)``: the last earlier instruction each exchange depends on
    (the wait that delivered what it forwards, the last compute or merge into a partial it
    sends, the previous exchange of its channel); -1 when none."""
    delivered: dict[tuple[Kind, int], int] = {}
    receives: dict[int, list[tuple[Kind, int]]] = {}
    touched: dict[tuple[Kind, int], int] = {}
    last_on: dict[str, int] = {}
    out = []
    for i, ins in enumerate(prog.instrs):
        if isinstance(ins, Exchange):
            ready = last_on.get(ins.channel, -1)
            for op in ins.ops:
                key = (op.payload.kind, op.payload.owner)
                if op.send and op.payload.kind.is_partial:
                    ready = max(ready, touched.pop(key, -1))
                elif op.send and op.payload.owner != prog.cp_rank:
                    ready = max(ready, delivered[key])
            # a DB completes a QB bundle (Note [Keeping foreign queries])
            receives[ins.handle] = [(held_input(o.payload.kind), o.payload.owner) for o in ins.ops]
            last_on[ins.channel] = i
            out.append((i, ready, ins))
        elif isinstance(ins, Wait):
            for key in receives[ins.handle]:
                delivered[key] = i
        elif isinstance(ins, Compute):
            if backward:
                touched[(Kind.DQ, ins.q_owner)] = touched[(Kind.DKV, ins.kv_owner)] = i
            else:
                touched[(Kind.O, ins.q_owner)] = i
        elif isinstance(ins, Merge):
            touched[(ins.payload.kind, ins.payload.owner)] = i
    return out


def _sends_partial(ex: Exchange) -> bool:
    return any(op.payload.kind.is_partial for op in ex.ops)


def _plans(n, p):
    for method in METHODS:
        if method not in ("charm", "a2a+p2p") and p != n:
            continue
        if method in ("a2a", "a2a+p2p") and n > 8:
            continue  # n**3 blocks per pass; smaller sizes cover the pattern
        for window in (1, 2):
            for causal in (True, False):
                yield build_plan(
                    PlanOptions(method=method, window=window), Layout(n // p, p), causal
                )


@pytest.mark.parametrize("n,p", SPLITS, ids=[f"{n // p}x{p}" for n, p in SPLITS])
def test_first_round_transfers_are_posted_before_the_first_block(n, p):
    for plan in _plans(n, p):
        window = plan.options.window
        for backward in (False, True):
            for prog in plan.programs(backward):
                first = next(i for i, ins in enumerate(prog.instrs) if isinstance(ins, Compute))
                # the first round ends where its results start to travel
                end = next(
                    (i for i, _, ex in ready_points(prog, backward) if _sends_partial(ex)),
                    len(prog.instrs),
                )
                per_channel: dict[str, int] = {}
                for i, ready, ex in ready_points(prog, backward):
                    if i > end or ex.channel.startswith("cross") or _sends_partial(ex):
                        continue  # cross inputs travel one node offset ahead by design
                    rank = per_channel[ex.channel] = per_channel.get(ex.channel, 0) + 1
                    if ready < first and rank <= window:
                        assert i < first, (plan.method, window, backward, prog.cp_rank, ex)
