"""Runs of block computes that one kernel call can do, and runs of partial gradients that one
sum folds in (pure; no torch).

Note [Coalesced blocks]
~~~~~~~~~~~~~~~~~~~~~~~
A plan computes attention block by block: one ``Compute`` per query piece and kv piece, so that
each block can start as soon as its two inputs are in. Where consecutive computes need no such
gap, because their blocks form a full product ``Z x Y`` of unmasked blocks on one head group
(every query piece of ``Z`` against every kv piece of ``Y``, each pair once), the executor runs
them as one kernel call on the concatenated pieces::

    compute q0.second x kv4.full          q = [q0.second; q1.second]     (tokens concatenated)
    compute q1.second x kv4.full    ->    kv = [kv4.full; kv5.full]
    compute q0.second x kv5.full          one unmasked block; out/dq split per query piece,
    compute q1.second x kv5.full          dk/dv per kv piece

Attention over a concatenation of keys is the merge of the attention over each (that is what
merging partials computes), and a query's dq sums over keys, a key's dk/dv over queries, so the
result is the same up to rounding, with one accumulator update per piece instead of one per
block. Fewer, larger calls cost less per FLOP on every device: on a GPU fewer launches and more
tiles in flight, on CPU less work outside the kernel. A causal (``masked``) block is never
coalesced: its mask is on local positions, which a concatenation would shift. Under a document
mask the executor runs every block's spans as before.

The plan does not change: the validator, the byte accounting and the simulator see the same
blocks. :func:`megatron_charm.plan.memory.pass_memory` replays a run as the executor does (one
accumulator update per piece, inputs released at the run's end); the concatenated copies of the
inputs are transient workspace of the call, like the kernel's own, and are not counted.

Note [Summed partials]
~~~~~~~~~~~~~~~~~~~~~~
A rank that receives partial gradients of one piece from several ranks merges each with its own
``Merge`` (the merges tell them apart by sender). Where merges of the same ``DQ`` or ``DKV``
payload follow one another, the executor folds them in with one sum::

    merge dkv3.first0/7 from 4                  dk += sum([dk from 4, dk from 5, dk from 6])
    merge dkv3.first0/7 from 5         ->       dv += sum([dv from 4, dv from 5, dv from 6])
    merge dkv3.first0/7 from 6                  (float32 sums, one update per tensor)

Gradients add, so the result is the same up to rounding. ``tasp``'s backward is the case: a
rank receives its chunk's partial from each of the ``n - 1`` others at every step, ``(n - 1)^2``
merges a backward, 16,129 on 128 ranks; a GPU host enqueues each merge's kernels (Note [Enqueue
ahead] in :mod:`megatron_charm.sim.engine`), so one sum per piece and step leaves ``2 (n - 1)``
or fewer. An output's partials merge by their lse, pairwise, and are not joined. No other
method's programs have such runs (every method, 1 x 4 to 4 x 8, causal or not).

As for blocks, the plan does not change. The memory replay releases a run's partials at its end,
as the executor does; the stacked copy that the sum reads is transient, like a run's
concatenated inputs. The simulator prices each merge by its bytes as before and enqueues a run
as one merge.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from megatron_charm.plan.types import Compute, Exchange, Instr, Kind, Merge


def _longest_product(instrs: Sequence[Instr], i: int, j: int) -> int:
    """The largest ``e`` in ``(i, j]`` such that ``instrs[i:e]`` (computes) is a full product
    (Note [Coalesced blocks]); ``i + 1`` if no run of two or more is. One pass: a part named
    twice differently or a pair met twice stays so in every longer run, so the scan stops
    there, and the rest of the test (pairs = query pieces x kv pieces) is checked at each
    length."""
    q_parts: dict[int, object] = {}
    kv_parts: dict[int, object] = {}
    pairs = set()
    best = i + 1
    for e in range(i, j):
        c = instrs[e]
        assert isinstance(c, Compute)
        if q_parts.setdefault(c.q_owner, c.q_part) != c.q_part:
            break
        if kv_parts.setdefault(c.kv_owner, c.kv_part) != c.kv_part:
            break
        pair = (c.q_owner, c.kv_owner)
        if pair in pairs:
            break
        pairs.add(pair)
        if e > i and len(pairs) == len(q_parts) * len(kv_parts):
            best = e + 1
    return best


def run_pieces(run: Sequence[Compute]) -> tuple[tuple, tuple]:
    """The parts of a run's distinct query pieces and of its distinct kv pieces, each in the
    order the run first uses them: what its one kernel call concatenates."""
    q_parts = {c.q_owner: c.q_part for c in run}
    kv_parts = {c.kv_owner: c.kv_part for c in run}
    return tuple(q_parts.values()), tuple(kv_parts.values())


def coalesced_runs(instrs: Sequence[Instr]) -> dict[int, int]:
    """``start -> end`` (exclusive) of every run of two or more consecutive computes that one
    kernel call does (Note [Coalesced blocks]); each run is the longest product from its start."""
    runs: dict[int, int] = {}
    i, n = 0, len(instrs)
    while i < n:
        first = instrs[i]
        end = i + 1
        if isinstance(first, Compute) and not first.masked:
            j = i + 1
            while j < n:
                c = instrs[j]
                if not isinstance(c, Compute) or c.masked or c.heads != first.heads:
                    break
                j += 1
            end = _longest_product(instrs, i, j)
        if end - i >= 2:
            runs[i] = end
        i = end
    return runs


def summed_runs(instrs: Sequence[Instr]) -> dict[int, int]:
    """``start -> end`` (exclusive) of every run of two or more consecutive merges of one ``DQ``
    or ``DKV`` payload, which the executor folds in with one sum (Note [Summed partials])."""
    runs: dict[int, int] = {}
    i, n = 0, len(instrs)
    while i < n:
        first, end = instrs[i], i + 1
        if isinstance(first, Merge) and first.payload.kind in (Kind.DQ, Kind.DKV):
            while end < n:
                m = instrs[end]
                if not isinstance(m, Merge) or m.payload != first.payload:
                    break
                end += 1
        if end - i >= 2:
            runs[i] = end
        i = end
    return runs


def joined_runs(instrs: Sequence[Instr], coalesce: bool = True) -> dict[int, int]:
    """Every run that one operation does: the coalesced runs of blocks (``coalesce``) and the
    summed runs of partials."""
    runs = summed_runs(instrs)
    if coalesce:
        runs.update(coalesced_runs(instrs))
    return runs


def steps(instrs: Sequence[Instr], coalesce: bool = True) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each step of a pass in order: one instruction, a run of computes that
    one kernel call does (``coalesce``), or a run of merges that one sum does. Inputs whose last
    use lies in a step are released after it, by the executor and by the memory replay alike."""
    runs = joined_runs(instrs, coalesce)
    i = 0
    while i < len(instrs):
        end = runs.get(i, i + 1)
        yield i, end
        i = end


def run_goes_on(instrs: Sequence[Instr], i: int) -> bool:
    """Whether instruction ``i`` is an exchange that another follows: a run of exchanges posted
    back to back goes on after it. The runner on gloo posts a run at its last exchange (Note
    [Receives of a run first] in :mod:`megatron_charm.comm.executor`), and the replay does the
    same (Note [Runs posted together] in :mod:`megatron_charm.sim.engine`)."""
    return (
        isinstance(instrs[i], Exchange)
        and i + 1 < len(instrs)
        and isinstance(instrs[i + 1], Exchange)
    )
