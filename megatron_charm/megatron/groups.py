"""Context-parallel process groups for CHARM+, derived from Megatron's parallel state.

CHARM+ needs to know which CP ranks share a node (fast links) and which do not (slow links). The
CP group comes from megatron-core (``pg_collection.cp``, or ``parallel_state`` as a fallback); the
node split ("ranks per node": a node is a block of that many consecutive CP ranks) comes from, in
order of precedence:

1. an explicit override: the ``ranks_per_node`` argument (the trainer's ``charm.ranks_per_node``
   config key, or the ``ranks_per_node`` spec parameter), then the environment variable
   ``MEGATRON_CHARM_RANKS_PER_NODE``;
2. ``--hierarchical-context-parallel-sizes A B`` (``config.hierarchical_context_parallel_sizes``):
   Megatron's level-0 groups are ``A`` contiguous CP ranks, exactly our notion of a node;
3. detection: node identities gathered over the CP group (done by ``CPTopology.build``): this
   module passes ``MEGATRON_CHARM_NODE_ID``, else the hostname (:func:`megatron_charm.env.node_id`).

``CPTopology.build`` creates process groups, which is collective over the whole job. It therefore
runs where every rank is present, exactly once per (CP group, split): :func:`build_charm_groups`
right after ``initialize_model_parallel`` (the patched ``initialize_megatron`` and
megatron-charm-train call it, so a pipeline stage without attention layers takes part too), or
else the first attention constructor. The result is cached and shared by all attention layers.
Before creating groups, the ranks compare their node splits in one small collective and all raise
if they differ. Building groups lazily inside ``forward`` would deadlock under pipeline
parallelism, where stages reach their first attention layer at different times.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_charm import env
from megatron_charm.nodes import check_node_split, cuda_device_pci, node_identity

logger = logging.getLogger("megatron_charm")

ENV_RANKS_PER_NODE = env.RANKS_PER_NODE
ENV_TIMEOUT = env.TIMEOUT_S

#: Cache: one CPTopology per (CP group ranks, node split), shared by every attention layer of the
#: process (building one is collective); ``clear_topology_cache`` destroys and empties it.
_TOPOLOGIES: dict[tuple[tuple[int, ...], int | None, bool], Any] = {}


@dataclass(frozen=True)
class NodeSplit:
    """How the CP group is split into nodes, and where that choice came from."""

    ranks_per_node: int | None
    """CP ranks per node; ``None`` means "detect from hostnames"."""
    source: str
    """Human-readable origin of the value (for the topology log line and error messages)."""


def get_cp_group(pg_collection: Any | None = None) -> dist.ProcessGroup:
    """Return the context-parallel group: ``pg_collection.cp``, else Megatron's ``parallel_state``.

    Raises:
        ValueError: if neither is available (model parallel state not initialised).
    """
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is not None:
        return group
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "CHARM+ needs the context-parallel process group, but pg_collection has no 'cp' and "
            "megatron.core.parallel_state is not initialised. Call "
            "parallel_state.initialize_model_parallel(...) before building the model, or pass a "
            "pg_collection with a 'cp' group."
        )
    return parallel_state.get_context_parallel_group()


def _parse_positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        number = -1
    elif isinstance(value, int):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    else:
        number = -1
    if number < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")
    return number


def resolve_node_split(
    cp_size: int,
    ranks_per_node: int | None = None,
    hierarchical_cp_sizes: list[int] | tuple[int, ...] | None = None,
    environ: dict[str, str] | None = None,
) -> NodeSplit:
    """Decide how many consecutive CP ranks form a node (pure; no communication).

    Args:
        cp_size: size of the CP group.
        ranks_per_node: explicit override (config key), or ``None``.
        hierarchical_cp_sizes: Megatron's ``hierarchical_context_parallel_sizes`` (``[A, B]``
            with ``A * B == cp_size``), or ``None``.
        environ: environment to read ``MEGATRON_CHARM_RANKS_PER_NODE`` from (``os.environ``).

    Raises:
        ValueError: if a value does not divide ``cp_size`` or is malformed; the message names the
            setting to change.
    """
    from_env = env.ranks_per_node(environ)
    if ranks_per_node is not None:
        rpn, source = (
            _parse_positive_int(ranks_per_node, "charm ranks_per_node"),
            "config ranks_per_node",
        )
    elif from_env is not None:
        rpn = _parse_positive_int(from_env, ENV_RANKS_PER_NODE)
        source = f"environment {ENV_RANKS_PER_NODE}"
    elif hierarchical_cp_sizes:
        sizes = [int(s) for s in hierarchical_cp_sizes]
        if len(sizes) != 2 or sizes[0] * sizes[1] != cp_size or min(sizes) < 1:
            raise ValueError(
                f"hierarchical_context_parallel_sizes={list(hierarchical_cp_sizes)} cannot be "
                f"used as a CHARM+ node split: CHARM+ needs exactly two levels [ranks_per_node, "
                f"num_nodes] whose product is the context-parallel size {cp_size}. Change "
                f"--hierarchical-context-parallel-sizes, or set charm ranks_per_node / "
                f"{ENV_RANKS_PER_NODE} instead."
            )
        rpn, source = sizes[0], "hierarchical_context_parallel_sizes"
    else:
        return NodeSplit(None, "hostnames gathered over the CP group")
    if cp_size % rpn != 0:
        raise ValueError(
            f"ranks_per_node={rpn} (from {source}) does not divide the context-parallel size "
            f"{cp_size}: every node must hold the same number of CP ranks. Set it to a divisor "
            f"of {cp_size}."
        )
    return NodeSplit(rpn, source)


def _timeout(timeout_s: float | None) -> datetime.timedelta:
    if timeout_s is None:
        return datetime.timedelta(seconds=env.timeout_s())
    if isinstance(timeout_s, bool) or not 0 < float(timeout_s) < float("inf"):
        raise ValueError(
            f"timeout_s={timeout_s!r} must be a positive number of seconds (Megatron-LM: "
            "--distributed-timeout-minutes; megatron-charm-train: parallel.timeout_s)."
        )
    return datetime.timedelta(seconds=float(timeout_s))


def get_charm_topology(
    pg_collection: Any | None = None,
    ranks_per_node: int | None = None,
    hierarchical_cp_sizes: list[int] | tuple[int, ...] | None = None,
    node_split: str = "host",
    timeout_s: float | None = None,
) -> Any:
    """Return the :class:`megatron_charm.CPTopology` for this rank's CP group (built once).

    Collective over the whole job the first time it is called for a given CP split: every rank
    must call it at model construction, in the same order (megatron-core builds attention layers
    in the same order on every rank, so the first ``CharmDotProductAttention`` constructor does).
    Later calls return the cached topology without communicating.

    Args:
        pg_collection: megatron-core ``ProcessGroupCollection`` (its ``cp`` group is used), or
            ``None`` for ``parallel_state``.
        ranks_per_node: explicit override of the node split, see :func:`resolve_node_split`.
        hierarchical_cp_sizes: Megatron's ``hierarchical_context_parallel_sizes``.
        node_split: what a detected node is, ``"host"`` or ``"numa"``
            (:func:`megatron_charm.nodes.node_identity`); only used when nothing above sets the
            split.
        timeout_s: seconds before a blocked exchange on the channel groups fails (Megatron-LM's
            ``--distributed-timeout-minutes``); ``None`` reads ``MEGATRON_CHARM_TIMEOUT_S``
            (default 600 s).

    Raises:
        ValueError: when the ranks of the job disagree on the node split (every rank raises), or
            a setting is malformed.
    """
    from megatron_charm import CPTopology

    cp_group = get_cp_group(pg_collection)
    cp_size = dist.get_world_size(cp_group)
    try:
        split = resolve_node_split(cp_size, ranks_per_node, hierarchical_cp_sizes)
        if split.source == "hierarchical_context_parallel_sizes":
            _check_hcp_groups_are_contiguous(pg_collection, cp_group, split.ranks_per_node)
        check_node_split(node_split)
    except ValueError as exc:
        # The other ranks may be about to create groups: tell them before raising here.
        _check_split_agreement(("invalid", str(exc)))
        raise
    detect = split.ranks_per_node is None and node_split != "host"
    key = (tuple(dist.get_process_group_ranks(cp_group)), split.ranks_per_node, detect)
    topo = _TOPOLOGIES.get(key)
    if topo is None:
        how = f"node_split={node_split}" if detect else ""
        _check_split_agreement((f"ranks_per_node={split.ranks_per_node} {how}", split.source))
        # CPTopology.build logs the layout itself; we log it once below, with its source.
        core_logger = logging.getLogger("megatron_charm.comm.topology")
        level = core_logger.level
        core_logger.setLevel(logging.WARNING)
        try:
            topo = CPTopology.build(
                cp_group,
                ranks_per_node=split.ranks_per_node,
                timeout=_timeout(timeout_s),
                # This is an entry point: the node identity comes from the environment here
                # (the testbed sets MEGATRON_CHARM_NODE_ID), and reaches the library as data.
                node_id=_numa_node_id() if detect else env.node_id(),
            )
        finally:
            core_logger.setLevel(level)
        _TOPOLOGIES[key] = topo
        if dist.get_rank() == 0:
            source = f"NUMA domains ({node_split=})" if detect else split.source
            logger.info("CHARM+ topology: %s; node split from %s", _describe(topo), source)
    return topo


def build_charm_groups(
    pg_collection: Any | None = None,
    ranks_per_node: int | None = None,
    hierarchical_cp_sizes: list[int] | tuple[int, ...] | None = None,
    node_split: str = "host",
    timeout_s: float | None = None,
) -> Any:
    """Build CHARM+'s channel groups now, on every rank, before any model is built.

    Call it where every rank of the job passes, right after megatron-core's
    ``initialize_model_parallel`` (the patched ``initialize_megatron`` and megatron-charm-train
    do). A rank that builds no attention layer (an embedding-only or loss-only pipeline stage)
    then still takes part in the collective group creation, instead of leaving the others
    waiting in it until the timeout. The attention layers built later find the groups in the
    cache; pass them the same settings. Arguments and errors as :func:`get_charm_topology`.
    """
    return get_charm_topology(
        pg_collection, ranks_per_node, hierarchical_cp_sizes, node_split, timeout_s
    )


def _check_split_agreement(mine: tuple[str, str]) -> None:
    """One small collective over the job: every rank raises when the node splits differ.

    ``mine`` is ``(split, where it came from)``, or ``("invalid", reason)`` on a rank whose
    settings are malformed. Group creation is collective over the whole job, so ranks that
    resolved different splits would otherwise wait in different ``new_group`` calls until the
    timeout.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if len({split for split, _ in gathered}) == 1 and gathered[0][0] != "invalid":
        return
    invalid = {
        global_rank: reason
        for global_rank, (split, reason) in enumerate(gathered)
        if split == "invalid"
    }
    if invalid:
        first = min(invalid)
        raise ValueError(
            f"the CHARM+ node split settings are invalid on global ranks {sorted(invalid)}; "
            f"rank {first}: {invalid[first]}"
        )
    by_value: dict[tuple[str, str], list[int]] = {}
    for global_rank, value in enumerate(gathered):
        by_value.setdefault(tuple(value), []).append(global_rank)
    listing = "; ".join(
        f"global ranks {ranks}: {split.strip()} (from {source})"
        for (split, source), ranks in by_value.items()
    )
    raise ValueError(
        f"the ranks of this job disagree on the CHARM+ node split ({listing}). Every rank must "
        "see the same --charm-ranks-per-node / charm ranks_per_node, "
        f"{ENV_RANKS_PER_NODE}, --hierarchical-context-parallel-sizes and "
        "--charm-node-split / parallel.node_split; set them the same way on every node."
    )


def _numa_node_id() -> str:
    import torch

    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    pci = cuda_device_pci(device) if device is not None else None
    return node_identity(env.node_id(), "numa", pci)


def _describe(topo: Any) -> str:
    describe = getattr(topo, "describe", None)
    if callable(describe):
        return str(describe())
    return f"cp_size={topo.cp_size}, {topo.num_nodes} node(s) x {topo.ranks_per_node} rank(s)"


def _check_hcp_groups_are_contiguous(
    pg_collection: Any | None, cp_group: dist.ProcessGroup, ranks_per_node: int | None
) -> None:
    """Check Megatron's level-0 hierarchical CP group is our node: contiguous CP ranks.

    Megatron builds level-0 groups of ``A`` contiguous CP ranks; we rely on that, so verify it
    when the groups are at hand instead of trusting the layout.
    """
    hcp = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
    if hcp is None:
        from megatron.core import parallel_state

        hcp = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if not hcp or ranks_per_node is None:
        return
    cp_ranks = dist.get_process_group_ranks(cp_group)
    cp_rank = dist.get_rank(cp_group)
    first = (cp_rank // ranks_per_node) * ranks_per_node
    expected = cp_ranks[first : first + ranks_per_node]
    level0 = dist.get_process_group_ranks(hcp[0])
    if sorted(level0) != sorted(expected):
        raise ValueError(
            f"Megatron's level-0 hierarchical CP group {level0} is not the block of "
            f"{ranks_per_node} consecutive CP ranks {expected} that CHARM+ treats as a node. "
            f"Set charm ranks_per_node / {ENV_RANKS_PER_NODE} explicitly instead of relying on "
            "--hierarchical-context-parallel-sizes."
        )


def cached_topologies() -> list[Any]:
    """The topologies built so far in this process (one per CP group and node split)."""
    return list(_TOPOLOGIES.values())


def clear_topology_cache() -> None:
    """Destroy and forget the cached topologies (tests, or with ``destroy_model_parallel``).

    Each one's channel and control groups are destroyed (:meth:`CPTopology.destroy
    <megatron_charm.CPTopology.destroy>`); a job that sets up its parallel state again otherwise
    keeps every earlier topology's groups, and on gloo their sockets. Every rank calls it, after
    its last attention call on them: a module that still holds a cleared topology raises
    ``ValueError`` at its next call. After the job's own ``destroy_process_group()`` it only
    forgets them."""
    topologies = list(_TOPOLOGIES.values())
    _TOPOLOGIES.clear()
    for topo in topologies:
        topo.destroy()
