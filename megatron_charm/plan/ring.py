"""Ring attention, as Transformer Engine's ``p2p`` runs it: the baseline.

Note [Ring schedule]
~~~~~~~~~~~~~~~~~~~~
Step ``i`` on rank ``x`` computes q_x against kv of ``x - i``; the kv for step ``i + 1`` is already
travelling from ``x - 1`` (double buffering), and each rank forwards what it received::

    step     0        1        2        3          (n = 4, rank 2)
    kv     kv2      kv1      kv0      kv3          recv from 1, send to 3, every step
    dkv    dkv2 ->  dkv1 ->  dkv0 ->  dkv3 -> 3    backward: partial dkv travels one step behind

The kv of a forwarded ring is always whole: a later rank may need the half that this one skips.
The backward sends each partial dkv on after adding this rank's block, and the last hop delivers
the completed dkv to its owner; partials travel in float32.

``ring-contig`` runs the same steps on the contiguous layout (Note [Contiguous layout]): a rank
skips the compute of an empty block, but the kv (and the partial dkv, passed on unchanged) still
travels, so the ring's bytes and dependent steps stay and only the work moves. n = 4, causal::

    step        0      1      2      3
    rank 0    q0kv0    -      -      -          1 block
    rank 3    q3kv3  q3kv2  q3kv1  q3kv0        4 blocks: the group's time
"""

from __future__ import annotations

from megatron_charm.plan.builder import ProgramBuilder, recv, send
from megatron_charm.plan.layout import ZIGZAG, block_empty, block_parts
from megatron_charm.plan.types import Kind, Part, Payload, Program

KV = "full.kv"
GRAD = "full.o"


def _shift(
    b: ProgramBuilder, channel: str, kind: Kind, owner: int, cp_size: int, held: int = 0
) -> None:
    """Send ``kind`` of ``owner`` to the next rank; receive the previous owner's from the last
    (``held``: the blocks in the previous rank's partial, for a partial ``kind``)."""
    x = b.cp_rank
    b.exchange(
        channel,
        [
            send((x + 1) % cp_size, kind, owner, Part.FULL),
            recv((x - 1) % cp_size, kind, (owner - 1) % cp_size, Part.FULL, held=held),
        ],
    )


def ring_forward(cp_rank: int, cp_size: int, causal: bool, seq_layout: str = ZIGZAG) -> Program:
    """Forward program of ``cp_rank`` on ``seq_layout`` (Note [Ring schedule])."""
    b = ProgramBuilder(cp_rank)
    for step in range(cp_size):
        owner = (cp_rank - step) % cp_size
        if step + 1 < cp_size:
            _shift(b, KV, Kind.KV, owner, cp_size)
        if not block_empty(cp_rank, owner, causal, seq_layout):
            b.compute(cp_rank, owner, *block_parts(cp_rank, owner, causal, seq_layout))
    return b.finish()


def ring_backward(cp_rank: int, cp_size: int, causal: bool, seq_layout: str = ZIGZAG) -> Program:
    """Backward program of ``cp_rank`` on ``seq_layout`` (Note [Ring schedule])."""
    b = ProgramBuilder(cp_rank)
    for step in range(cp_size):
        owner = (cp_rank - step) % cp_size
        if step + 1 < cp_size:
            _shift(b, KV, Kind.KV, owner, cp_size)
        if not block_empty(cp_rank, owner, causal, seq_layout):
            parts = block_parts(cp_rank, owner, causal, seq_layout)
            b.compute(cp_rank, owner, *parts, q_kind=Kind.QB)
        if cp_size == 1:
            break
        if step > 0:
            b.merge(_dkv(owner))
        # the previous rank's partial: its own block at step 0, merged with what came before
        # at every later step
        _shift(b, GRAD, Kind.DKV, owner, cp_size, held=1 if step == 0 else 2)
    if cp_size > 1:
        b.merge(_dkv(cp_rank))
    return b.finish()


def _dkv(owner: int) -> Payload:
    return Payload(Kind.DKV, owner, Part.FULL)
