"""All-to-all ("Ulysses") context parallelism, as Transformer Engine's ``a2a`` runs it.

Note [All-to-all schedule]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Ulysses trades the sequence split for a head split: each rank gathers every rank's tokens for
one group of heads, ``n`` groups for a CP group of ``n`` (group ``g``: query heads
``[g*h/n, (g+1)*h/n)``, kv heads likewise of ``h_kv``), computes attention over the whole
sequence for its group, and sends each rank's tokens of the result back. Both all-to-alls are
written as direct exchanges, one per offset ``o``, as the all-gather is (Note [All-gather
schedule]): rank ``x`` sends its q (on ``full.q``) and kv (on ``full.kv``) restricted to head
group ``x + o`` to ``x + o`` and receives those of ``x - o`` restricted to group ``x``. Every token
travels, causal or not: the head split leaves no part of the sequence unused.

The attention over the gathered sequence is computed as the ``n x n`` blocks of the zigzag layout
(:func:`megatron_charm.plan.layout.block_parts`), each on ``1/n`` of the heads: the same work as a
rank's ``n`` full blocks. The own block comes first, and each arriving owner is paired with every
owner received before it (its row, its column, its own block), so compute overlaps the
transfers; blocks with equal parts sit next to each other, which the executor runs as one call
(Note [Coalesced blocks]). The results of a head group are
complete only when every kv has arrived; the last owner's blocks are therefore computed in the
order the results go back, each result posted as soon as it is complete, so the returns overlap
the tail of the compute. n = 4, rank 1 (head group 1, ``h1``)::

    forward    post q ->2 (h2) <-0 (h1), kv likewise      o = 1   (whole tokens)
               post q ->3 (h3) <-3 (h1), kv likewise      o = 2
               post q ->0 (h0) <-2 (h1), kv likewise      o = 3
               compute q1 x kv1; with 0: q0 x kv1, q1 x kv0, q0 x kv0; with 3: the same
               with 2 (last): q2's row -> post o2.h1 ->2 <-0 o1.h0
                              q3 x kv2 -> post o3.h1 ->3 <-3 o1.h3
                              q0 x kv2 -> post o0.h1 ->0 <-2 o1.h2;  q1 x kv2
               place o1.h0, o1.h3, o1.h2 into their head slices

    backward   the same exchanges with the backward bundle (q, dout, lse, delta) instead of q
               and dq in place of o; then post every dk/dv of head group 1 to its owner (the
               last owner's column completes them all)

A returned partial holds its owner's result for one head group in full: the owner places it into
its head slice instead of merging it, and it travels in the input dtype (Note [Wire precision]).
A rank holds the q and kv of every rank for its head group: ``(h + 2 h_kv) / n`` heads of the
whole sequence, the footprint of Ulysses. The head split needs ``h % n == 0`` and
``h_kv % n == 0``: like Transformer Engine, kv heads are not replicated when there are fewer kv
heads than ranks (:func:`check_heads`).
"""

from __future__ import annotations

from megatron_charm.plan.builder import ProgramBuilder, recv, send
from megatron_charm.plan.layout import block_parts
from megatron_charm.plan.types import Heads, Kind, Part, Payload, Program

# q (or the backward bundle) and kv on channels of their own: on NCCL they move concurrently
QUERIES = "full.q"
KEYS = "full.kv"
RESULTS = "full.o"


def check_heads(
    h: int, h_kv: int, ranks: int, method: str = "a2a", ranks_name: str = "cp_size"
) -> None:
    """Refuse a head count that the all-to-all cannot split over ``ranks`` ranks (named
    ``ranks_name``: the CP size for ``a2a``, the ranks per node for ``a2a+p2p``)."""
    if h % ranks or h_kv % ranks:
        group = "CP group" if ranks_name == "cp_size" else "ranks of a node"
        raise ValueError(
            f"method {method} splits the heads over the {group}: query heads h={h} and kv heads "
            f"h_kv={h_kv} must both be divisible by {ranks_name}={ranks} (kv heads are not "
            "replicated); change the head counts (num_attention_heads / num_query_groups), the "
            f"{'context-parallel size' if ranks_name == 'cp_size' else 'node split'}, or the "
            "method (method= / --cp-comm-type / --methods)"
        )


def _post_inputs(b: ProgramBuilder, cp_size: int, q_kind: Kind) -> list[int]:
    """Post every input exchange; return the owners in arrival order, this rank's first."""
    x = b.cp_rank
    mine = Heads(x, cp_size)
    for o in range(1, cp_size):
        dst, src = (x + o) % cp_size, (x - o) % cp_size
        theirs = Heads(dst, cp_size)
        for kind, channel in ((q_kind, QUERIES), (Kind.KV, KEYS)):
            b.exchange(
                channel,
                [
                    send(dst, kind, x, Part.FULL, theirs),
                    recv(src, kind, src, Part.FULL, mine),
                ],
            )
    return [(x - o) % cp_size for o in range(cp_size)]


class _Blocks:
    """Computes blocks of this rank's head group."""

    def __init__(self, b: ProgramBuilder, cp_size: int, causal: bool, q_kind: Kind) -> None:
        self.b, self.causal, self.q_kind = b, causal, q_kind
        self.heads = Heads(b.cp_rank, cp_size)

    def __call__(self, z: int, y: int) -> None:
        parts = block_parts(z, y, self.causal)
        self.b.compute(z, y, *parts, q_kind=self.q_kind, heads=self.heads)

    def early(self, owners: list[int]) -> None:
        """Every block among the owners but the last, each once both of its inputs are in."""
        seen: list[int] = []
        for new in owners[:-1]:
            # its row (needs its q), its column (its kv), then its own block, each in owner
            # order: consecutive blocks with equal parts are one kernel call (Note [Coalesced
            # blocks])
            for y in sorted(seen):
                self(new, y)
            for y in sorted(seen):
                self(y, new)
            self(new, new)
            seen.append(new)


def _return(b: ProgramBuilder, kind: Kind, o: int, cp_size: int) -> None:
    """Post, at offset ``o``, the result of ``x + o`` for this rank's head group; receive this
    rank's result for the head group of ``x - o``."""
    x = b.cp_rank
    dst, src = (x + o) % cp_size, (x - o) % cp_size
    b.exchange(
        RESULTS,
        [
            send(dst, kind, dst, Part.FULL, Heads(x, cp_size)),
            recv(src, kind, x, Part.FULL, Heads(src, cp_size)),
        ],
    )


def _place(b: ProgramBuilder, kind: Kind, cp_size: int) -> None:
    x = b.cp_rank
    for o in range(1, cp_size):
        b.merge(Payload(kind, x, Part.FULL, Heads((x - o) % cp_size, cp_size)))


def _compute_and_return(cp_rank: int, cp_size: int, causal: bool, backward: bool) -> ProgramBuilder:
    """Gather head group ``cp_rank`` of every owner's inputs, compute every block, and return each
    owner's q-side result (out, or dq) as soon as it is complete."""
    b = ProgramBuilder(cp_rank)
    q_kind, result = (Kind.QB, Kind.DQ) if backward else (Kind.Q, Kind.O)
    block = _Blocks(b, cp_size, causal, q_kind)
    owners = _post_inputs(b, cp_size, q_kind)
    block.early(owners)
    last, x = owners[-1], cp_rank
    # the last owner completes every result: its row first (its own result goes back first,
    # at o = 1), then each other owner's block right before that owner's return
    if cp_size > 1:
        for y in sorted(owners):
            block(last, y)
        _return(b, result, 1, cp_size)
        for o in range(2, cp_size):
            block((x + o) % cp_size, last)
            _return(b, result, o, cp_size)
    block(x, last)
    return b


def a2a_forward(cp_rank: int, cp_size: int, causal: bool) -> Program:
    """Forward program of ``cp_rank`` (Note [All-to-all schedule])."""
    b = _compute_and_return(cp_rank, cp_size, causal, backward=False)
    _place(b, Kind.O, cp_size)
    return b.finish()


def a2a_backward(cp_rank: int, cp_size: int, causal: bool) -> Program:
    """Backward program of ``cp_rank``: gather the bundle and kv of head group ``cp_rank``,
    compute, return each dq and dk/dv to its owner (Note [All-to-all schedule])."""
    b = _compute_and_return(cp_rank, cp_size, causal, backward=True)
    # every dk/dv of this head group is complete now (the last owner's column is done)
    for o in range(1, cp_size):
        _return(b, Kind.DKV, o, cp_size)
    _place(b, Kind.DQ, cp_size)
    _place(b, Kind.DKV, cp_size)
    return b.finish()
