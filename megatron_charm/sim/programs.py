"""Which programs the simulator replays: all ranks of a plan, or one node's ranks and symmetry.

Note [Node symmetry]
~~~~~~~~~~~~~~~~~~~~
Building every rank's program is the dominant cost at scale (``build_plan`` for 128 x 8 ranks
takes minutes), and replaying millions of instructions in Python is not much cheaper. But the
schedules are symmetric under a relabelling of nodes that maps node ``a`` to node 0:

* ``ring``, ``all_gather``, ``a2a``, ``a2a+p2p`` and ``charm``: a shift by whole nodes,
  ``r -> (r - a*p) mod n`` (``ring-contig`` too, but only for non-causal attention: causally its
  nodes do different work, the last the most, so it is always replayed in full);
* ``merge`` and ``rm+``: ``r -> r XOR (a*p)`` (partners are ``x XOR j``; needs ``p`` and ``n``
  powers of two so that no partner is skipped).

In ``"symmetric"`` mode only node 0's ``p`` programs are built and replayed. A transfer is
keyed by its endpoints' *local* indices, the node distance between them (difference or XOR of
node indices) and its sequence number on the channel. The two local ranks holding the two ends of
a class of transfers (the sender's side on one, the mirror of the receiver's side on the other)
then meet under one key, and the cross-link resources of node 0 carry exactly one copy of each
class. For non-causal attention this replays the full schedule exactly (tests check it).

For causal attention the zigzag parts differ between nodes (node ``a`` sends whole queries to the
``a`` nodes below it and second halves to the nodes above, and charm ships a whole foreign query
as two halves in two rounds), so symmetric mode is an approximation. Where a class's two local
sides name different sizes, each side runs as its own flow of its own size on its own side's
resources (Note [Each side its own size] in :mod:`megatron_charm.sim.engine`; until 2026-12-07
they ran as one flow of the larger size). For charm the nodes do not even agree on how many
cross-node transfers a class has, so its cross-node transfers run unmatched: each starts when its
own side's exchange starts, one side of it. ``tasp``'s too: node 0's ranks return full chunk
partials to the ranks above them and receive first halves from them, which the mirrored class
names the other way round, and a step's returns share one exchange. Against full replays
(4 x 2 to 8 x 8; the Note has them): ring, a2a and a2a+p2p (which move whole tokens) exact;
charm -15%..0%; rm+ within 5%; merge's backward up to +20% and all_gather's -10% (their
forwards exact); tasp's backward up to +14%. Compute is exact (every causal block costs half a
full one). Methods without a node symmetry (causal ``ring-contig`` and ``a2a+charm``, two-node
charm) replay every rank in every mode.

Two-node charm has no such symmetry: its two nodes order their cross-node returns differently,
the lower node's result first (Note [Receiving results early]), so it is always replayed in full
(at most ``2 p`` ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megatron_charm.plan import (
    AttnShape,
    PlanOptions,
    plan_levels,
    plan_with_levels,
    rank_plan,
)
from megatron_charm.plan.bulk import collector_paused
from megatron_charm.plan.types import Layout, Program

MODES = ("auto", "full", "symmetric")

# In "auto" mode, CP groups up to this size are replayed in full. Causal node symmetry is an
# approximation (charm -10% forward on 16 x 8, -19% before each side ran its own size), and a
# full replay of 128 ranks takes 10-14 s a method whose programs grow linearly with the ranks
# since flows are rerated once per instant (docs/simulator.md, "Speed and node symmetry").
FULL_MODE_MAX_RANKS = 128
#: Methods whose programs grow with the square of the ranks (every rank exchanges with every
#: other at every step), and the largest group that ``"auto"`` replays them in full: ``tasp``'s
#: full replay took 53 s on 8 x 8 and more than 15 minutes on 16 x 8 (node 0's: 4 and 19 s),
#: ``a2a``'s 10 and 80 s (2026-12-07, docs/simulator.md, "Speed and node symmetry"). Both
#: replay exactly under node symmetry without a causal mask, and ``a2a`` with one too.
QUADRATIC_METHODS = ("tasp", "a2a")
QUADRATIC_FULL_MAX_RANKS = 32
#: The largest error of a causal one-node replay against the full replay, per method whose
#: one-node replay is approximate (ring, a2a and a2a+p2p replay exactly), rounded up: over the
#: groups of ``scripts/bench/symmetric_error.py`` (4 x 2 to 8 x 8; docs/results/symmetric-
#: error.md) and of its ``--large`` (the H100 preset on 16 x 8 to 64 x 8; charm's backward
#: -21.7% on 64 x 8, rm+'s +6.4%; docs/results/symmetric-error-large.md). What a prediction's
#: range adds where a method was replayed so (:func:`megatron_charm.sim.predict.replay_error`).
SYMMETRIC_ERROR = {"charm": 0.22, "merge": 0.20, "tasp": 0.14, "all_gather": 0.10, "rm+": 0.07}


@dataclass(frozen=True)
class ProgramSet:
    """The programs one pass replays and how transfers to ranks outside them are matched."""

    options: PlanOptions
    layout: Layout
    causal: bool
    forward: tuple[Program, ...]
    backward: tuple[Program, ...]
    symmetry: str
    """``"none"`` (all ranks present); ``"shift"`` or ``"xor"``: one node (Note [Node symmetry])."""

    @property
    def method(self) -> str:
        return self.options.method

    @property
    def cp_ranks(self) -> list[int]:
        return [p.cp_rank for p in self.forward]

    @property
    def unmatched_cross(self) -> bool:
        """Whether cross-node transfers run unmatched (symmetric causal charm, whose nodes
        differ in how many cross transfers they send and receive, and tasp, whose nodes differ
        in their sizes; Note [Node symmetry])."""
        return self.symmetry != "none" and self.causal and self.method in ("charm", "tasp")

    @property
    def exact(self) -> bool:
        """Whether the replay is exact (every rank present, or a symmetric non-causal plan)."""
        return self.symmetry == "none" or not self.causal


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def symmetry_of(method: str, layout: Layout, causal: bool = False) -> str | None:
    """The node symmetry of ``method`` on ``layout`` (``causal`` or not), or ``None`` when it has
    none we can use."""
    if layout.num_nodes == 1 or (causal and method == "ring-contig"):
        return None
    if method == "charm" and layout.num_nodes == 2:
        return None  # its two nodes order their returns differently (see the Note)
    if method == "a2a+charm":  # causal: a node's queries cross whole or halved by direction
        return None if causal else "shift"
    if method in ("ring", "all_gather", "a2a", "a2a+p2p", "charm", "ring-contig", "tasp"):
        return "shift"
    if _pow2(layout.ranks_per_node) and _pow2(layout.cp_size):
        return "xor"
    return None


@lru_cache(maxsize=32)
def node_programs(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    node: int = 0,
    cross: tuple[str, str] | None = None,
    intra: tuple[str, str] | None = None,
) -> ProgramSet:
    """Programs of one node's ranks only (``"symmetric"`` mode, Note [Node symmetry]).

    Each is the rank's own plan (:func:`megatron_charm.plan.rank_plan`), with the wire
    precisions it has in the whole plan, receives from other nodes included."""
    method = options.method
    sym = symmetry_of(method, layout, causal)
    if sym is None:
        raise ValueError(
            f"method {method!r} on {layout.num_nodes}x{layout.ranks_per_node} has no node "
            "symmetry to exploit (merge/rm+ need power-of-two sizes; causal ring-contig has "
            "none; one node needs none); use mode='full'"
        )
    p = layout.ranks_per_node
    ranks = range(node * p, (node + 1) * p)
    if cross is None or intra is None:
        cross, intra = plan_levels(options, layout, causal)
    with collector_paused():  # Note [Pausing the cyclic collector]
        fwd, bwd = zip(
            *(rank_plan(options, layout, causal, cross, x, intra) for x in ranks), strict=True
        )
    return ProgramSet(options, layout, causal, tuple(fwd), tuple(bwd), sym)


def programs(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    mode: str = "auto",
    shape: AttnShape | None = None,
    full_max: int = FULL_MODE_MAX_RANKS,
) -> ProgramSet:
    """Programs to replay for ``options`` on ``layout`` (see :data:`MODES`; ``"symmetric"``
    replays every rank of a method that has no node symmetry, :func:`symmetry_of`); ``shape``
    decides charm's ``cross_level`` and ``intra_level`` ``"auto"`` as
    :func:`megatron_charm.plan.plan_levels` does; ``full_max``: the largest group that
    ``"auto"`` replays in full (:data:`QUADRATIC_FULL_MAX_RANKS` at most for
    :data:`QUADRATIC_METHODS`)."""
    cross, intra = plan_levels(options, layout, causal, shape)
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}; use auto, full or symmetric")
    if options.method in QUADRATIC_METHODS:
        full_max = min(full_max, QUADRATIC_FULL_MAX_RANKS)
    if mode == "auto" and layout.cp_size <= full_max:
        mode = "full"
    if mode != "full" and symmetry_of(options.method, layout, causal) is not None:
        return node_programs(options, layout, causal, 0, cross, intra)
    plan = plan_with_levels(options, layout, causal, cross, intra=intra)
    return ProgramSet(options, layout, causal, plan.forward, plan.backward, "none")
