"""TASP, the paper's topology-aware baseline (Wang et al., 2025, arXiv:2509.26541), on our planner.

Note [TASP schedule]
~~~~~~~~~~~~~~~~~~~~
Our reading of TASP: ring attention's kv all-gather uses one link per rank at each of its
``n - 1`` steps, while an NVSwitch (or any fully connected) node offers ``n - 1``. TASP cuts each
rank's kv into ``n - 1`` chunks and runs ``n - 1`` rings at once, ring ``j`` on the ``j``-th
cycle of a Hamiltonian decomposition of the complete directed graph on the ranks: those cycles
use every ordered pair of ranks exactly once, so at every step every link carries exactly one
chunk and no two rings share a link. After ``n - 1`` steps every rank has seen every chunk, as
after a ring's ``n - 1`` steps. Its bytes per rank equal the ring's; its steps are as many; what
changes is that they spread over all links. The paper measures TASP's forward only (its code
has no backward) and needs the sequence divisible by ``n (n - 1)``.

We schedule the same link pattern with each chunk sent straight from its owner: at step ``t``
rank ``x`` sends chunk ``t`` of its kv to every other rank and receives chunk ``t`` of every other
rank's kv. Each ordered pair again carries one chunk per step, so every link carries the same
bytes at every step as under the Hamiltonian rings. A decomposition does not exist for 4 and 6
ranks (Tillson, 1980), so the relayed form cannot run on our 2 x 2 testbed; the direct form runs
at every size. Like our all-gather, a chunk holds only the part of the kv its receiver uses
under the zigzag layout (:func:`megatron_charm.plan.layout.block_parts`): chunks of the first
half go to higher ranks. n = 4 (3 chunks), rank 1, causal::

    forward    post step 0: kv1.first0/3 ->2,->3  kv1.full0/3 ->0;  <-0 kv0.first0/3
                            <-2 kv2.full0/3  <-3 kv3.full0/3
               post step 1 likewise; compute q1 x kv1 (causal)
               step t = 0, 1, 2: compute q1 x chunk t of kv0, kv3, kv2; wait for step t + 1,
               then post step t + 2

    backward   the same kv steps; after the computes of step t, post one exchange that
               returns every dk/dv chunk partial straight to its owner and receives this rank's
               chunk t partials from every peer; merge them one step later (the reduce-scatter
               of Note [All-gather schedule], in steps; the executor sums a step's partials
               of one chunk part at once, Note [Summed partials]). A step's returns share one
               exchange as its kv does: one exchange per peer and step posted 240 exchanges a
               backward per rank on 16 ranks where this posts 30 with the kv's. On NCCL the
               exchanges of one channel run one after another, so per-peer returns also ran in
               sequence, and each cost the host a call (Note [Enqueue ahead] in
               :mod:`megatron_charm.sim.engine`)

Two steps are in flight at once (double buffering), so a rank holds two steps' chunks: two
blocks' worth of kv, as a ring holds. Off-diagonal blocks are unmasked in the zigzag layout, so
a chunk needs no mask of its own; the diagonal block is the own kv, which never travels.
"""

from __future__ import annotations

from collections.abc import Iterator

from megatron_charm.plan.builder import ProgramBuilder, recv, send
from megatron_charm.plan.layout import block_parts
from megatron_charm.plan.types import Chunk, Kind, Part, Payload, Program, chunk

KV = "full.kv"
GRAD = "full.o"


def check_tasp_shape(s_local: int, cp_size: int) -> None:
    """Refuse a local sequence that TASP cannot cut into ``cp_size - 1`` chunks of each zigzag
    half."""
    pieces = 2 * max(cp_size - 1, 1)
    if s_local % pieces:
        raise ValueError(
            f"method tasp cuts each rank's kv into cp_size - 1 = {cp_size - 1} chunks of each "
            f"zigzag half: the local sequence s_local={s_local} must be divisible by "
            f"2 * (cp_size - 1) = {pieces} (the global one by {pieces * cp_size}); change the "
            "sequence length, the context-parallel size or the method (method= / --methods)"
        )


def check_paper_tasp_shape(s_local: int, cp_size: int) -> None:
    """Refuse a local sequence that the paper's TASP cannot run: its rule, a global sequence
    divisible by ``n (n - 1)`` (``s_local`` by ``n - 1``). Looser than :func:`check_tasp_shape`,
    whose chunks also split the zigzag halves; the simulator replays the paper's TASP by this
    rule, since it prices chunks as fractions of a rank's tokens (Note [The paper's baselines] in
    :mod:`megatron_charm.sim.baselines`)."""
    pieces = max(cp_size - 1, 1)
    if s_local % pieces:
        raise ValueError(
            f"the paper's TASP needs the sequence divisible by n (n - 1) = {pieces * cp_size} "
            f"(its Table 5 note): the local sequence s_local={s_local} does not divide into "
            f"cp_size - 1 = {pieces} chunks; change the sequence length or leave tasp out"
        )


class _Cuts:
    """The peers and kv chunks one rank moves, each peer's part found once (a program names
    ``(cp_size - 1)^2`` chunks; at CP 1024 finding each again cost a third of planning)."""

    def __init__(self, cp_rank: int, cp_size: int, causal: bool) -> None:
        x, self.count = cp_rank, cp_size - 1
        #: the other ranks at offsets 1, 2, ... above and below this one, mod cp_size
        self.ahead = [(x + o) % cp_size for o in range(1, cp_size)]
        self.behind = [(x - o) % cp_size for o in range(1, cp_size)]
        # the part of x's kv that peer y uses, and the part of y's kv that x uses
        self._out = {y: block_parts(y, x, causal)[1] for y in self.ahead}
        self._in = {y: block_parts(x, y, causal)[1] for y in self.ahead}

    def sent(self, y: int, step: int) -> Part | Chunk:
        """Chunk ``step`` of this rank's kv that peer ``y`` uses."""
        return chunk(self._out[y], step, self.count)

    def used(self, y: int, step: int) -> Part | Chunk:
        """Chunk ``step`` of peer ``y``'s kv that this rank uses."""
        return chunk(self._in[y], step, self.count)


def _post_step(b: ProgramBuilder, cuts: _Cuts, step: int) -> int:
    x = b.cp_rank
    return b.exchange(
        KV,
        [send(y, Kind.KV, x, cuts.sent(y, step)) for y in cuts.ahead]
        + [recv(y, Kind.KV, y, cuts.used(y, step)) for y in cuts.behind],
    )


def _kv_steps(b: ProgramBuilder, cuts: _Cuts, causal: bool, q_kind: Kind) -> Iterator[int]:
    """Post the kv steps two ahead (double buffering) around the computes; yield after each
    step's computes so the backward can return that step's partials."""
    x, steps = b.cp_rank, cuts.count
    handles = [_post_step(b, cuts, t) for t in range(min(steps, 2))]
    b.compute(x, x, *block_parts(x, x, causal), q_kind=q_kind)
    q_parts = {y: block_parts(x, y, causal)[0] for y in cuts.behind}
    for t in range(steps):
        for y in cuts.behind:
            b.compute(x, y, q_parts[y], cuts.used(y, t), False, q_kind=q_kind)
        yield t
        if t + 2 < steps:
            # step t + 1 replaces step t's chunks as it lands: wait for it before the next
            # step's buffers are posted, so two steps are held at a time, as a ring holds two kv
            b.wait(handles[t + 1])
            handles.append(_post_step(b, cuts, t + 2))


def tasp_forward(cp_rank: int, cp_size: int, causal: bool) -> Program:
    """Forward program of ``cp_rank`` (Note [TASP schedule])."""
    b = ProgramBuilder(cp_rank)
    for _ in _kv_steps(b, _Cuts(cp_rank, cp_size, causal), causal, Kind.Q):
        pass
    return b.finish()


def tasp_backward(cp_rank: int, cp_size: int, causal: bool) -> Program:
    """Backward program of ``cp_rank``: the forward's kv steps, each followed by returning the
    step's dk/dv chunk partials to their owners (Note [TASP schedule])."""
    x = cp_rank
    b = ProgramBuilder(x)
    cuts = _Cuts(x, cp_size, causal)
    steps = cp_size - 1
    for t in _kv_steps(b, cuts, causal, Kind.QB):
        # one exchange a step, as the kv's: a rank returns every peer's chunk partial and
        # receives its own chunk's from every peer (the merges tell those apart by sender)
        b.exchange(
            GRAD,
            [send(y, Kind.DKV, y, cuts.used(y, t)) for y in cuts.behind]
            + [recv(z, Kind.DKV, x, cuts.sent(z, t), held=1) for z in cuts.ahead],
        )
        # one step behind: the partials of step t - 1 have had a step's compute to arrive
        if t > 0:
            _merge_step(b, cuts, t - 1)
    if steps:
        _merge_step(b, cuts, steps - 1)
    return b.finish()


def _merge_step(b: ProgramBuilder, cuts: _Cuts, step: int) -> None:
    for z in cuts.ahead:
        b.merge(Payload(Kind.DKV, b.cp_rank, cuts.sent(z, step)))
