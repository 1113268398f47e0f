"""All-gather context parallelism, as Transformer Engine's ``all_gather`` (and Llama 3) runs it.

Note [All-gather schedule]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Every rank gathers the kv of every other rank and computes its own q against all of it; nothing
but kv moves in the forward. The gather is written as direct exchanges, one per offset ``o``:
rank ``x`` sends its kv to ``x + o`` and receives the kv of ``x - o`` (all ranks post offsets in
the same order, so every exchange meets its peers' in posting order). All exchanges are posted
before the first compute, so the transfers overlap the own (diagonal) block and each other, and
each block waits only for its own kv. Under the causal zigzag layout only the part of kv that the
receiver's queries see travels (:func:`megatron_charm.plan.layout.block_parts`): the first half
to higher ranks, all of it to lower ranks. n = 4, rank 1::

    forward    post kv  ->2 kv1.first  <-0 kv0.first      o = 1
               post kv  ->3 kv1.first  <-3 kv3.full       o = 2
               post kv  ->0 kv1.full   <-2 kv2.full       o = 3
               compute q1 x kv1 (causal), then q1 x kv0, kv3, kv2 as each arrives

    backward   the same kv exchanges again, then for each offset:
               compute q1 x kv(1-o)  ->  dq1 += ..., dkv(1-o) partial
               post dkv ->(1-o) dkv(1-o)   <-(1+o) dkv1           (reduce-scatter, pairwise)
               merge the dkv1 partial received one offset earlier

The backward's reduce-scatter of dk/dv is the same pattern reversed: each partial dk/dv goes
straight back to its owner, which sums them in its float32 accumulator. Each partial holds one
block, so it travels as the kernel produced it (Note [Wire precision]). Unlike a ring, no partial
is forwarded, and no transfer depends on another; the price is that a rank holds the kv of every
rank at once (``n - 1`` receive buffers), as an all-gather does.
"""

from __future__ import annotations

from megatron_charm.plan.builder import ProgramBuilder, recv, send
from megatron_charm.plan.layout import block_parts
from megatron_charm.plan.types import Kind, Part, Payload, Program

KV = "full.kv"
GRAD = "full.o"


def _kv_part(q_owner: int, kv_owner: int, causal: bool) -> Part:
    return block_parts(q_owner, kv_owner, causal)[1]


def _post_gather(b: ProgramBuilder, cp_size: int, causal: bool) -> None:
    """Post every kv exchange: at offset ``o``, own kv to ``x + o``, kv of ``x - o`` in."""
    x = b.cp_rank
    for o in range(1, cp_size):
        dst, src = (x + o) % cp_size, (x - o) % cp_size
        b.exchange(
            KV,
            [
                send(dst, Kind.KV, x, _kv_part(dst, x, causal)),
                recv(src, Kind.KV, src, _kv_part(x, src, causal)),
            ],
        )


def allgather_forward(cp_rank: int, cp_size: int, causal: bool) -> Program:
    """Forward program of ``cp_rank`` (Note [All-gather schedule])."""
    b = ProgramBuilder(cp_rank)
    _post_gather(b, cp_size, causal)
    for o in range(cp_size):
        owner = (cp_rank - o) % cp_size
        b.compute(cp_rank, owner, *block_parts(cp_rank, owner, causal))
    return b.finish()


def allgather_backward(cp_rank: int, cp_size: int, causal: bool) -> Program:
    """Backward program of ``cp_rank``: gather kv again, compute, return each partial dk/dv to
    its owner and merge the ones returned to this rank (Note [All-gather schedule])."""
    x = cp_rank
    b = ProgramBuilder(x)
    _post_gather(b, cp_size, causal)
    b.compute(x, x, *block_parts(x, x, causal), q_kind=Kind.QB)
    for o in range(1, cp_size):
        src, dst = (x - o) % cp_size, (x + o) % cp_size
        b.compute(x, src, *block_parts(x, src, causal), q_kind=Kind.QB)
        b.exchange(
            GRAD,
            [
                send(src, Kind.DKV, src, _kv_part(x, src, causal)),
                recv(dst, Kind.DKV, x, _kv_part(dst, x, causal), held=1),  # dst's one block
            ],
        )
        # one offset behind: the partial of o - 1 has had a block's time to arrive
        if o > 1:
            b.merge(_returned(x, o - 1, cp_size, causal))
    if cp_size > 1:
        b.merge(_returned(x, cp_size - 1, cp_size, causal))
    return b.finish()


def _returned(x: int, o: int, cp_size: int, causal: bool) -> Payload:
    """The partial dk/dv of ``x`` that rank ``x + o`` returns."""
    return Payload(Kind.DKV, x, _kv_part((x + o) % cp_size, x, causal))
