"""Plan options: everything, besides the problem itself, that decides a schedule.

One frozen object travels whole from the user (``cp_attention``, the Megatron module, the trainer's
YAML, the bench CLI) to the planner, and every rank of a CP group checks that it runs the same one
(:mod:`megatron_charm.comm.agreement`). No option list is repeated in a signature.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields, replace

METHODS: tuple[str, ...] = (
    "charm",
    "rm+",
    "merge",
    "ring",
    "all_gather",
    "a2a",
    "a2a+p2p",
    "a2a+charm",
    "ring-contig",
    "tasp",
)
"""Every CP attention method the planner builds (``--cp-comm-type`` values)."""

BASELINES: tuple[str, ...] = ("ring-contig", "tasp", "a2a+charm")
"""Methods that exist to compare against (the paper's baselines, and ``a2a+charm``, a trial that
no measurement has shown faster than every other method): ``cp_attention``, the bench and the
simulator run them; Megatron, our trainer and ``auto`` do not offer them."""

SEQ_LAYOUT_OF: dict[str, str] = {"ring-contig": "contiguous"}
"""Methods whose causal inputs are in the contiguous layout (Note [Contiguous layout] in
:mod:`megatron_charm.plan.layout`); every other method expects the zigzag layout."""

TE_CP_COMM_TYPES: tuple[str, ...] = ("p2p", "a2a", "all_gather", "a2a+p2p")
"""``--cp-comm-type`` values that Transformer Engine serves in Megatron-LM and in our trainer;
there a name that both serve keeps TE's meaning (``all_gather`` is ours only in
``cp_attention``, the bench and the simulator)."""

MEGATRON_METHODS: tuple[str, ...] = tuple(
    m
    for m in METHODS
    if m not in SEQ_LAYOUT_OF and m not in TE_CP_COMM_TYPES and m not in BASELINES
)
"""Our methods as Megatron ``--cp-comm-type`` values: Megatron shards zigzag, TE's names stay
TE's, and the baselines are for comparison only."""

CROSS_RETURNS: tuple[str, ...] = ("fp32", "input")
CROSS_LEVELS: tuple[str, ...] = ("auto", "q", "kv")
INTRA_LEVELS: tuple[str, ...] = ("auto", "split", "kv")
FOREIGN_Q: tuple[str, ...] = ("auto", "keep", "resend")


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(
            f"unknown CP attention method {method!r}; expected one of {', '.join(METHODS)} "
            "(set method= / --cp-comm-type accordingly)"
        )


@dataclass(frozen=True)
class PlanOptions:
    """How to schedule CP attention. Frozen and hashable: plans are cached by it."""

    method: str = "charm"
    """``charm`` (CHARM+), ``rm+``, ``merge``, ``ring`` (Transformer Engine's ``p2p``),
    ``all_gather`` (Transformer Engine's ``all_gather``), ``a2a`` (Ulysses, Transformer
    Engine's ``a2a``), ``a2a+p2p`` (all-to-all inside a node, ring across nodes: Transformer
    Engine's hierarchical ``a2a+p2p``), ``a2a+charm`` (all-to-all inside a node, CHARM+'s
    queries across nodes: Note [A2a+charm schedule]), ``ring-contig`` (the ring on the
    contiguous layout: the unbalanced Ring-Attention baseline) or ``tasp`` (the paper's TASP
    baseline: kv chunks to every rank at every step, Note [TASP schedule])."""

    window: int = 2
    """Exchanges in flight per channel in the merge/RM+/CHARM+ pipelines (>= 1): more overlaps
    more transfers with compute and holds more received inputs at once. The default is the
    smallest window within 1% of the best predicted time over the simulator's grid
    (``scripts/bench/window_rule.py``, docs/results/window-rule.md)."""

    combine_nodes: bool = False
    """charm on two or more nodes with queries crossing: the paper's Algorithm 2, every node's
    queries cross whole and run one source node a step, the first step with the node's own (on
    two nodes: one pipeline), instead of one round per foreign piece (Note [CHARM+ rounds], Note
    [Algorithm 2 per step]). Fewer operations per rank, less overlap of the cross transfers. Off
    by default (docs/results/window-rule.md has the simulator's comparison)."""

    cross_return: str = "input"
    """Wire precision of node-merged partial results that cross nodes (charm's returned outputs
    and dq): ``fp32`` keeps full precision, ``input`` sends them in the input dtype (half the
    return bytes on the slow link for one more rounding)."""

    cross_level: str = "auto"
    """What charm ships across nodes: ``q`` (the paper's query parallelism: q goes out once, its
    results come back, kv never crosses), ``kv`` (each kv crosses once to its counterpart and is
    shared inside the node; q never crosses) or ``auto``: per pass, whichever moves fewer bytes on
    the busiest cross link for the call's head counts (GQA models ship kv, MHA ships q)."""

    intra_level: str = "auto"
    """What charm's ranks exchange inside a node: ``split`` (RM+, the paper's Algorithm 1: kv
    with some partners, queries with the others, on two channels), ``kv`` (the merge mechanism:
    kv with every partner) or ``auto``: per pass, whichever puts fewer bytes on the busiest
    rank's node-local links, then holds less memory (GQA models exchange kv, whose heads are
    fewer). Matters from three ranks per node on (Note [Intra level])."""

    foreign_q: str = "auto"
    """What charm's backward does with the queries that crossed nodes in the forward: ``keep``
    them on the rank that received them, so the bundle crossing back ships dout, lse and delta
    only (half its bytes with multi-head attention; the kept queries are held from the forward
    to the backward), ``resend`` them with the bundle (nothing held between the passes), or
    ``auto``: keep unless that takes the attention memory above both ``memory_budget`` and what
    resending holds (Note [Keeping foreign queries] in :mod:`megatron_charm.plan.keep`). No
    effect where kv crosses nodes."""

    memory_budget: float = 1.1
    """The attention memory (a pass's peak buffers, plus the out and lse saved for the backward)
    that charm's ``auto`` choices may use, as a multiple of ring attention's on the same problem
    (> 0). Choices within it are ranked by bytes; only if none fits does the one with fewer bytes
    win regardless. Lower trades node-local bytes for memory (docs/results/memory.md)."""

    def __post_init__(self) -> None:
        check_method(self.method)
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(
                f"window={self.window!r}: the prefetch window must be an integer >= 1 "
                "(set window= / --window)"
            )
        if self.cross_return not in CROSS_RETURNS:
            raise ValueError(
                f"cross_return={self.cross_return!r}: expected one of {', '.join(CROSS_RETURNS)} "
                "(set cross_return= / --cross-return)"
            )
        if self.cross_level not in CROSS_LEVELS:
            raise ValueError(
                f"cross_level={self.cross_level!r}: expected one of {', '.join(CROSS_LEVELS)} "
                "(set cross_level= / --cross-level)"
            )
        if self.foreign_q not in FOREIGN_Q:
            raise ValueError(
                f"foreign_q={self.foreign_q!r}: expected one of {', '.join(FOREIGN_Q)} "
                "(set foreign_q= / --foreign-q)"
            )
        if self.intra_level not in INTRA_LEVELS:
            raise ValueError(
                f"intra_level={self.intra_level!r}: expected one of {', '.join(INTRA_LEVELS)} "
                "(set intra_level= / --intra-level)"
            )
        budget = self.memory_budget
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0:
            raise ValueError(
                f"memory_budget={budget!r}: expected a number > 0, a multiple of ring "
                "attention's memory (set memory_budget= / --memory-budget)"
            )
        if not isinstance(self.combine_nodes, bool):
            raise ValueError(f"combine_nodes={self.combine_nodes!r} must be a bool (true or false)")

    @property
    def seq_layout(self) -> str:
        """The sequence layout the method expects of causal inputs: ``zigzag`` or ``contiguous``."""
        return SEQ_LAYOUT_OF.get(self.method, "zigzag")

    def replace(self, **changes: object) -> PlanOptions:
        """A copy with ``changes`` applied (validated like the original)."""
        return replace(self, **changes)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> PlanOptions:
        """Build from a config mapping; unknown keys are an error that names them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown plan option(s) {unknown}; expected some of {sorted(known)}")
        return cls(**values)  # type: ignore[arg-type]


#: Every plan option but the method (which each tool sets per contender), in declaration order.
PLAN_KEYS: tuple[str, ...] = tuple(f.name for f in fields(PlanOptions) if f.name != "method")

#: Help of each plan option's command-line flag (every CLI that takes plan options uses these).
FLAG_HELP: dict[str, str] = {
    "window": "plan option: exchanges in flight per channel in the pipelines (>= 1)",
    "cross_return": "plan option: precision of charm's node-merged results crossing nodes",
    "cross_level": "plan option: what charm ships across nodes (q, kv, or auto: fewer bytes)",
    "intra_level": "plan option: what charm exchanges inside a node (split: RM+, kv, or auto)",
    "foreign_q": "plan option: charm's backward keeps the forward's foreign queries or resends",
    "memory_budget": "plan option: attention memory auto choices may use, x ring's (> 0)",
    "combine_nodes": "plan option: charm's q across whole, a step per source node (Algorithm 2)",
}


def flag_name(key: str, prefix: str = "") -> str:
    """``cross_return`` -> ``--cross-return`` (``--charm-cross-return`` with prefix ``charm-``)."""
    return f"--{prefix}{key.replace('_', '-')}"


def add_plan_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    prefix: str = "",
    keys: tuple[str, ...] = tuple(FLAG_HELP),
) -> None:
    """Add ``--<prefix><option>`` flags for the plan options ``keys`` to an argparse parser or
    group, with :class:`PlanOptions`' defaults and choices."""
    defaults = PlanOptions()
    choices = {
        "cross_return": CROSS_RETURNS,
        "cross_level": CROSS_LEVELS,
        "intra_level": INTRA_LEVELS,
        "foreign_q": FOREIGN_Q,
    }
    for key in keys:
        if key == "combine_nodes":
            parser.add_argument(flag_name(key, prefix), action="store_true", help=FLAG_HELP[key])
        elif key == "window":
            parser.add_argument(
                flag_name(key, prefix), type=int, default=defaults.window, help=FLAG_HELP[key]
            )
        elif key == "memory_budget":
            parser.add_argument(
                flag_name(key, prefix),
                type=float,
                default=defaults.memory_budget,
                help=FLAG_HELP[key],
            )
        else:
            parser.add_argument(
                flag_name(key, prefix),
                choices=choices[key],
                default=getattr(defaults, key),
                help=FLAG_HELP[key],
            )


def plan_values_from_args(
    args: object, prefix: str = "", keys: tuple[str, ...] = tuple(FLAG_HELP)
) -> dict[str, object]:
    """The values of the flags :func:`add_plan_arguments` added, keyed by plan option."""
    return {key: getattr(args, (prefix + key).replace("-", "_")) for key in keys}
