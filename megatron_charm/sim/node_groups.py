"""CP groups that share their nodes: tensor parallelism and data-parallel replicas (pure).

Note [Groups sharing a node]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A topology describes one CP group of ``m x p`` ranks. Megatron orders ranks with tensor
parallelism innermost, so with TP ``t`` a node of ``g * p`` GPUs holds ``p`` ranks of each of
``g >= t`` CP groups (one per TP rank, times the data-parallel replicas on the node). They run
the same layer at the same time, so their transfers meet on every link that is not a GPU's own::

    node of 8 GPUs, TP 2, CP 2 x 4:   GPU  0  1  2  3  4  5  6  7
                                      CP   a  b  a  b  a  b  a  b     (groups a and b)
    one NIC per GPU (rails):          each group on its own NICs          -> unchanged
    k NICs per node, or one (shared): both groups' cross bytes on them  -> cross_bw / g
    PCIe root complex (pcie_domain):  every GPU's PCIe flows on it      -> pcie_domain / g
    NVLink ports, a GPU's PCIe link:  the GPU's own                     -> unchanged

With ``g`` groups a link that is not a GPU's own carries ``g`` flows where one group's replay
sees one, so each of its flows gets ``1 / g`` of the link: the replay divides the link's rate
by ``g``. A fixed cost that is time on the link (``cross_lat_on_link``, H20) is paid by every
group's transfer in turn, so it grows ``g`` times. This is the pessimistic case, the groups'
transfers all at once, as data-parallel replicas and the TP ranks of one layer run in lockstep;
where they do not all overlap, each group gets more than ``1 / g`` of the link.

On a CPU testbed profile, whose ranks share one host's cores (``shared_slots``), the other
groups' blocks would share those cores too; the replay does not add them, so there the count
covers the links only.

So with ``g > 1``, ``rails`` means one NIC per GPU, and ``shared`` or ``nics_per_node=k`` count
the node's own links, which every group's ranks share. Presets keep their links per node
(H100's two links, L20's NUMA link): a CP group of 4 on an H100 node with TP 2 gets half of
them.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_charm.sim.topology import Topology


def shared_by(topo: Topology, groups: int) -> Topology:
    """``topo`` as one of ``groups`` CP groups on the same nodes sees it (Note [Groups sharing a
    node]): cross links that are not one per GPU, and the PCIe root complex, at ``1 / groups``
    of their rate; ``groups=1``: ``topo`` itself."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(
            f"groups per node {groups!r} must be an integer >= 1: the CP groups whose ranks "
            "share each node (GPUs per node / CP ranks per node; --groups-per-node, or --tp)"
        )
    if groups == 1:
        return topo
    changes: dict = {}
    if topo.nics_per_node or topo.cross_links == "shared":
        changes["cross_bw"] = topo.cross_bw / groups
        if topo.cross_lat_on_link:
            changes["cross_lat"] = topo.cross_lat * groups
    if topo.pcie_domain > 0:
        changes["pcie_domain"] = topo.pcie_domain / groups
    return replace(topo, **changes) if changes else topo


def per_rank_heads(heads: int, kv_heads: int, tp: int) -> tuple[int, int]:
    """``(heads, kv_heads)`` of one tensor-parallel rank's attention, as Megatron core splits
    them: ``heads / tp`` query heads; ``kv_heads / tp`` kv heads, or one (replicated) where
    ``kv_heads`` divides ``tp`` (``num_query_groups`` a multiple or divisor of the TP size)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp {tp!r} must be an integer >= 1 (the tensor-parallel size)")
    if min(heads, kv_heads) < 1:
        # checked here: a kv head count of 0 would become one replicated kv head below
        raise ValueError(
            f"--heads {heads} and --kv-heads {kv_heads} must be positive (the model's query "
            "heads and kv heads, num_attention_heads and num_query_groups); change --heads or "
            "--kv-heads"
        )
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise ValueError(
            f"--heads {heads} must be divisible by --tp {tp}, and --kv-heads {kv_heads} a "
            "multiple or a divisor of it: Megatron gives each tensor-parallel rank heads / TP "
            "query heads and kv heads / TP kv heads (one where TP is larger); pass the model's "
            "head counts and a TP size that fits them"
        )
    return heads // tp, max(1, kv_heads // tp)
