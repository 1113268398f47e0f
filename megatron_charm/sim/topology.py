"""Topology model: ``m`` nodes of ``p`` ranks, intra- and cross-node links, and link contention.

Note [Links and contention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every transfer is a *flow* from a sender to a receiver. It first waits out the link latency, then
moves its bytes at a rate that is the smallest fair share of the *resources* it crosses (equal
share: ``capacity / number of active flows`` on each resource, re-evaluated whenever a flow starts
or ends):

* intra-node, ``fabric="nvlink"``: every flow gets the full point-to-point bandwidth (an
  NVSwitch fabric: the paper's "contention-free"), up to the GPU's NVLink capacity per
  direction when ``nvlink_egress`` is set (``nvl_out[cp_rank]``, ``nvl_in[cp_rank]``): an
  H100's 18 NVLink 4 links carry 450 GB/s each way, so two concurrent flows of Table 2's
  365 GB/s from one GPU share it.
* intra-node, ``fabric="pcie"``: each GPU's PCIe link is a resource in each direction
  (``pcie_out[cp_rank]``, ``pcie_in[cp_rank]``), so concurrent transfers of one GPU share its
  bandwidth (paper section 2.1). Cross-node/NUMA flows cross the endpoints' PCIe links too.
  With ``pcie_domain`` set, every PCIe flow also crosses its node's (NUMA domain's) root
  complex, up at the sender's node and down at the receiver's (``pcie_up[node]``,
  ``pcie_down[node]``), which carry ``pcie_domain`` GB/s each: concurrent transfers of different
  GPUs share it too. The paper's Figure 1(a) draws this: one transfer at full bandwidth, several
  at a limited one ("link contention"), and its Table 2 measures one transfer. L20 sets it to that
  one transfer's 24 GB/s (Note [One PCIe domain] below).
* cross-node, ``cross_links="shared"``: one link per node and direction (``nic_out[node]``,
  ``nic_in[node]``) shared by all ranks of the node (a NUMA interconnect, or one NIC per node).
* cross-node, ``cross_links="rails"``: one link per rank and direction (one NIC per GPU, rail
  optimised), so ranks with different local indices do not contend. ``nics_per_node=k`` sits in
  between: ``p / k`` neighbouring ranks share one of ``k`` links.
* cross-node, ``cross_mesh=True``: one link per ordered pair of nodes (``pair``), the CPU
  testbed's build: with ``shared`` a node sends to two other nodes at the full rate each; with
  ``rails`` one such link per pair and rail, a transfer taking its destination's rail (as
  NCCL's PXN does). On two nodes ``shared`` is the same either way.
* ``cross_lat_on_link=True``: a cross transfer's fixed cost is time on its link, as if it
  moved ``cross_lat x cross_bw`` bytes more, shared with the link's other flows: ``k`` transfers
  that start together on one link all finish after ``k`` fixed costs (and their bytes), where
  as a delay they would pay one.
* ``cross_fifo=True``: a cross link serves its flows first come, first served instead of in
  equal shares; flows that start together share it. The CPU testbed shapes each link with a
  tbf whose queue holds at least 200 ms of traffic (``tbf_params`` in
  :mod:`megatron_charm.testbed.net`): a transfer posted while another's bytes fill the queue
  waits behind them. On 2 x 2 causal charm this decides its critical path: a node's second
  query half and its returned outputs share one direction, and in equal shares the half
  arrives late (charm's forward was predicted 21-30% too slow there, 2026-12-04).

Channels (kv, q, out, cross q/out) are independent: they contend only through these resources.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megatron_charm.sim.compute import Enqueue, FlopsCompute

FABRICS = ("nvlink", "pcie")
#: Achieved fractions of peak in attention blocks, of a full wave of tiles (Note [Tiles and waves]
#: in megatron_charm/sim/compute.py). H100: the paper's own Table 5 gives it (Note [The paper's
#: baselines] in megatron_charm/sim/baselines.py); H20: its Table 4 ring rows (Note [Constants
#: from the ring rows] in megatron_charm/sim/ring_rows.py); L20: fitted on Table 4's speedups.
EFF_L20, EFF_H20, EFF_H100 = 0.773, 0.329, 0.68
#: H20's transfers in the paper's runs, from its Table 4 ring rows (Note [Constants from the ring
#: rows] in megatron_charm/sim/ring_rows.py, which recomputes them; a test checks these):
#: fractions of Table 2's intra- and cross-node bandwidth, and seconds of fixed cost per transfer.
H20_INTRA_RATE, H20_INTRA_LAT = 0.153, 1.96e-4
H20_CROSS_RATE, H20_CROSS_LAT = 0.251, 1.09e-3
#: What an H100 cross-node transfer achieves in the paper's schedules, over Table 2's 42.5 GB/s:
#: Table 5's ring forward moves its kv at 26.7 GB/s on 2 x 8 and 25.6 GB/s on 4 x 8 (0.63 and
#: 0.60; Note [The paper's baselines] in megatron_charm/sim/baselines.py).
H100_CROSS_RATE = 0.62
#: What each of an H100 node's NICs achieves in one step of the paper's TASP all-to-all (one NIC
#: per GPU), over Table 2's 42.5 GB/s: Table 5's TASP forward sends ``n - p`` of each rank's
#: ``n - 1`` kv chunks across nodes per step, at 0.48 of it on 2 x 8 (0.45 on 4 x 8, which is
#: predicted; Note [The paper's baselines] in megatron_charm/sim/baselines.py).
H100_A2A_RATE = 0.48
#: Seconds of fixed cost per intra-node transfer where nothing gives one (the default of
#: Topology and Hardware, L20's): about what NCCL alone takes for a small send/recv between two
#: NVLink GPUs (3-10 us: NVIDIA/nccl issue 1487, nccl-tests issue 331).
ASSUMED_INTRA_LAT = 5e-6
#: Seconds of fixed cost per intra-node (NVLink) transfer in the paper's H100 runs: fitted on the
#: appendix's rise of the speedup with batch (Note [H100's NVLink fixed cost]).
H100_INTRA_LAT = 40e-6

# Note [H100's NVLink fixed cost]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Table 5 cannot see what an NVLink transfer of the paper's H100 runs costs beyond its bytes:
# ring's steps wait for their cross-node transfer (9 ms of bytes at its first row, against well
# under 1 ms inside a node), and CHARM+'s rows move by at most one point between 5 and 40 us.
# Two sources bracket it. NCCL alone takes 3-10 us for its smallest send/recv between two NVLink
# GPUs (NVIDIA/nccl#1487 on H100, NVIDIA/nccl-tests#331 on A100); the paper's own H20 runs pay
# 196 us per NVLink transfer (Table 4's ring rows, H20_INTRA_LAT), the same code on a sibling
# HGX board. What places it is the shape of the paper's appendix: at a fixed sequence, CHARM+'s
# speedup rises from about 1.6x at batch 1 to 2.3x at the largest batches (Table 5's 128 x
# 3,360 row is 2.28x). A fixed cost per transfer is what gives that shape: ring's steps are
# gated by their cross-node transfer, CHARM+'s merge levels by their NVLink transfers, so the
# cost lands on CHARM+'s critical path and not on ring's, and weighs least where the bytes
# are many. 2 x 8 forward at 3,360 tokens, batch 1 / 2 / 4 / 16
# (scripts/bench/paper_structure.py with --set H100.intra_lat=...):
#
#     intra fixed cost    speedups
#        5 us             2.23  2.26  2.27  2.28           (the preset until 2026-12-05)
#       10 us             2.11  2.19  2.23  2.27           (NCCL's own)
#       25 us             1.81  2.00  2.13  2.24
#       40 us             1.59  1.84  2.03  2.21           (the preset)
#       50 us             1.47  1.75  1.97  2.20
#      196 us             1.61  1.32  1.38  1.95           (the paper's H20 runs)
#
# A larger host cost per operation (Note [Enqueue ahead] in megatron_charm/sim/engine.py) does
# not give it: at 40-60 us per operation the speedup falls off a cliff where the host bounds
# CHARM+ (1.61x at batch 1, 2.15x at 2) and dips below that at 1,680 tokens. 40 us is one
# constant fitted on one statement of the text, not a measurement; `calibrate` measures a
# user's own (Note [Fitting a profile] in megatron_charm/sim/profile.py).

# Note [A fixed cost on the link]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# H20's ring rows give 1.09 ms of fixed cost per cross-node transfer (Note [Constants from the
# ring rows] in megatron_charm/sim/ring_rows.py). A ring step sends one transfer out of each node
# at a time, so those rows cannot say where the cost sits: a delay that concurrent transfers
# wait out side by side, or time on the link that they pay one after another
# (Topology.cross_lat_on_link). Nor how many links a node has: one transfer never shares one.
# The two-node RM+ and CHARM+ rows can. Per forward, RM+ sends 96 transfers out of a node (the
# whole group's merge levels cross it), the paper's CHARM+ 16 (its queries out, the outputs
# back), ring 15. Predicted speedup's error of the four two-node H20 rows (RM+ and CHARM+ at
# 1,792 tokens, then at 7,168), by links per node and where the fixed cost sits:
#
#     links   fixed cost     RM+ 1792   CHARM+ 1792   RM+ 7168   CHARM+ 7168
#       2     delay            -6%         +4%          -30%        -25%      (preset until
#       4     delay           +51%        +41%          +28%        +10%       2026-12-05)
#       1     on the link     -77%        -63%          -73%        -63%
#       2     on the link     -55%        -33%          -47%        -36%
#       4     on the link     -12%        +13%           +3%         +2%      (the preset)
#       8     on the link     +69%        +72%          +95%        +44%      (one a GPU)
#
# Only four links with the cost on the link put all four within +-25%: the fixed costs add up
# with the transfers a link carries (RM+'s many small ones at 1,792 tokens), and the bytes
# spread over four links (its large ones at 7,168). What the cost is, the paper does not say: a
# millisecond is no wire latency (NCCL's tests report tens of microseconds); something each
# transfer of its H20 runs pays that one NIC's transfers do not overlap (a rendezvous, a
# proxy's per-message work). H100's rows show no fixed cost (their transfers are too large to
# tell it from the rate), and its preset keeps a 10 us delay and two links per node. On a user's
# cluster `calibrate` measures where the fixed cost sits (Note [Fitting a profile] in
# megatron_charm/sim/profile.py). Each line
# of the table: python -m megatron_charm.sim.validation --gpus H20 --set H20.nics_per_node=K
# --set H20.cross_lat_on_link=0|1 (K = 0 for one a GPU).
CROSS_LINKS = ("shared", "rails")
EXCHANGE_ORDERS = ("channel", "pair")


@dataclass(frozen=True)
class Topology:
    """Cluster links for a CP group of ``num_nodes x ranks_per_node`` ranks."""

    num_nodes: int
    """``m``: nodes (or NUMA domains) in the CP group."""
    ranks_per_node: int
    """``p``: CP ranks per node; CP rank ``r`` lives on node ``r // p``."""
    intra_bw: float
    """Point-to-point bandwidth between two ranks of one node, GB/s (1e9 bytes/s), one direction."""
    cross_bw: float
    """Bandwidth of one cross-node link, GB/s, one direction."""
    intra_lat: float = ASSUMED_INTRA_LAT
    """Latency of an intra-node transfer, seconds (fixed cost before the bytes flow)."""
    cross_lat: float = 10e-6
    """Latency of a cross-node transfer, seconds."""
    fabric: str = "nvlink"
    """Intra-node fabric: ``"nvlink"`` (contention-free) or ``"pcie"`` (per-GPU links shared)."""
    cross_links: str = "rails"
    """``"rails"``: one cross link per rank; ``"shared"``: one per node, shared by its ranks."""
    nics_per_node: int = 0
    """Cross links per node when neither extreme fits (``k`` links, local ranks ``l * k // p``
    share one); 0: ``cross_links`` decides (shared = 1, rails = ``p``)."""
    cross_mesh: bool = False
    """Cross links join ordered pairs of nodes (a full mesh, as the CPU testbed builds them)
    instead of leaving each node through its own ``nics`` (Note [Links and contention])."""
    cross_fifo: bool = False
    """Each cross link serves its transfers first come, first served (those that start
    together share it), as a deep FIFO queue in front of the link does, instead of in equal
    shares (Note [Links and contention])."""
    cross_lat_on_link: bool = False
    """A cross-node transfer's fixed cost (``cross_lat``) is time on its link rather than a delay
    before its bytes flow: the link carries ``cross_lat x cross_bw`` bytes more for it, shared
    with concurrent flows like its own bytes, so concurrent transfers pay their fixed costs one
    after another (Note [Links and contention]; the H20 preset, Note [A fixed cost on the link])."""
    nvlink_egress: float = 0.0
    """GB/s that all of one GPU's intra-node NVLink flows share in each direction (Note [Links
    and contention]); 0: none, every flow at ``intra_bw`` however many run."""
    pcie_domain: float = 0.0
    """GB/s that all PCIe flows of one node share in each direction, up into its root complex
    and down out of it (Note [Links and contention]); 0: only each GPU's own link is shared.
    Used with ``fabric="pcie"`` only."""
    exchange_order: str = "channel"
    """How a rank's exchanges on one channel proceed (Note [Replay semantics] in
    :mod:`megatron_charm.sim.engine`): ``"channel"`` one after another, as NCCL runs them on
    one stream per communicator; ``"pair"`` at once, keeping only each pair's transfers in
    order, and a run of consecutive exchanges posted at its last, as the runner posts them on
    gloo (Note [Runs posted together] in :mod:`megatron_charm.sim.engine`)."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"topology {self.num_nodes}x{self.ranks_per_node}: nodes and ranks per node must "
                "be >= 1; pass e.g. --gpus 2x8"
            )
        if not all(math.isfinite(x) and x > 0 for x in (self.intra_bw, self.cross_bw)):
            raise ValueError(
                f"bandwidths must be > 0 GB/s (intra {self.intra_bw}, cross {self.cross_bw}); "
                "pass positive --intra-bw/--cross-bw"
            )
        if not all(math.isfinite(x) and x >= 0 for x in (self.intra_lat, self.cross_lat)):
            raise ValueError(
                f"latencies must be finite and >= 0 seconds (intra {self.intra_lat}, cross "
                f"{self.cross_lat}); pass --intra-lat-us/--cross-lat-us of 0 or more"
            )
        if not (math.isfinite(self.nvlink_egress) and self.nvlink_egress >= 0):
            raise ValueError(
                f"nvlink_egress {self.nvlink_egress} must be >= 0 GB/s (0: no cap per GPU); "
                "fix nvlink_egress in the --profile JSON"
            )
        if self.fabric not in FABRICS:
            raise ValueError(
                f"fabric {self.fabric!r} is not one of {FABRICS}; use --fabric nvlink or pcie"
            )
        if not (math.isfinite(self.pcie_domain) and self.pcie_domain >= 0):
            raise ValueError(
                f"pcie_domain {self.pcie_domain} must be >= 0 GB/s (0: no shared root complex); "
                "pass --pcie-domain-bw 0 or more"
            )
        if self.nics_per_node and self.ranks_per_node % self.nics_per_node:
            raise ValueError(
                f"nics_per_node {self.nics_per_node} must divide ranks_per_node "
                f"{self.ranks_per_node}; pass --nics-per-node a divisor of it, or 0 (one per rank)"
            )
        if not isinstance(self.cross_lat_on_link, bool):
            raise ValueError(
                f"cross_lat_on_link={self.cross_lat_on_link!r} must be a bool (true or false); "
                "fix cross_lat_on_link in the --profile JSON"
            )
        if self.exchange_order not in EXCHANGE_ORDERS:
            raise ValueError(
                f"exchange_order {self.exchange_order!r} is not one of {EXCHANGE_ORDERS}: "
                "'channel' for NCCL, 'pair' for gloo; fix exchange_order in the --profile JSON"
            )
        if self.cross_links not in CROSS_LINKS:
            raise ValueError(
                f"cross_links {self.cross_links!r} is not one of {CROSS_LINKS}; "
                "use --cross-links shared or rails"
            )

    @property
    def cp_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def node(self, cp_rank: int) -> int:
        return cp_rank // self.ranks_per_node

    def same_node(self, a: int, b: int) -> bool:
        return a // self.ranks_per_node == b // self.ranks_per_node

    def link_class(self, src: int, dst: int) -> str:
        """``"intra"`` or ``"cross"`` for a transfer from ``src`` to ``dst`` (CP ranks)."""
        return "intra" if self.same_node(src, dst) else "cross"

    def bandwidth(self, link_class: str) -> float:
        """Bytes per second of an uncontended flow of ``link_class``."""
        return (self.intra_bw if link_class == "intra" else self.cross_bw) * 1e9

    def fixed_cost(self, link_class: str) -> float:
        """Seconds a lone transfer of ``link_class`` takes beyond its bytes."""
        return self.intra_lat if link_class == "intra" else self.cross_lat

    def on_link(self, link_class: str) -> bool:
        """Whether a transfer's fixed cost is time on its link (:attr:`cross_lat_on_link`)."""
        return link_class == "cross" and self.cross_lat_on_link

    def latency(self, link_class: str) -> float:
        """Seconds before a transfer of ``link_class``'s bytes flow."""
        return 0.0 if self.on_link(link_class) else self.fixed_cost(link_class)

    def held_bytes(self, link_class: str) -> float:
        """Bytes a transfer of ``link_class`` adds to its link for its fixed cost; 0 where the
        fixed cost is a delay."""
        if not self.on_link(link_class):
            return 0.0
        return self.fixed_cost(link_class) * self.bandwidth(link_class)

    def resources(self, src: int, dst: int) -> tuple[tuple[str, int], ...]:
        """Shared resources a flow from ``src`` to ``dst`` crosses (Note [Links and contention])."""
        res: list[tuple[str, int]] = []
        if self.fabric == "pcie":
            res += [("pcie_out", src), ("pcie_in", dst)]
            if self.pcie_domain > 0:
                res += [("pcie_up", self.node(src)), ("pcie_down", self.node(dst))]
        if self.same_node(src, dst):
            if self.fabric == "nvlink" and self.nvlink_egress > 0:
                res += [("nvl_out", src), ("nvl_in", dst)]
            return tuple(res)
        if self.cross_mesh:
            rails = self.ranks_per_node if self.cross_links == "rails" else 1
            rail = dst % self.ranks_per_node if rails > 1 else 0
            pair = self.node(src) * self.num_nodes + self.node(dst)
            return (*res, ("pair", pair * rails + rail))
        return (*res, ("nic_out", self.nic(src)), ("nic_in", self.nic(dst)))

    @property
    def nics(self) -> int:
        """Cross links per node and direction."""
        if self.nics_per_node:
            return self.nics_per_node
        return 1 if self.cross_links == "shared" else self.ranks_per_node

    def nic(self, cp_rank: int) -> int:
        """Global index of the cross link that ``cp_rank`` uses."""
        p, k = self.ranks_per_node, self.nics
        return self.node(cp_rank) * k + (cp_rank % p) * k // p

    def capacity(self, resource: tuple[str, int]) -> float:
        """Bytes per second of a resource."""
        kind = resource[0]
        if kind.startswith("nvl"):
            return self.nvlink_egress * 1e9
        if kind in ("pcie_up", "pcie_down"):
            return self.pcie_domain * 1e9
        return (self.intra_bw if kind.startswith("pcie") else self.cross_bw) * 1e9


@dataclass(frozen=True)
class Hardware:
    """A GPU system from the paper's Table 2 (plus link assumptions the table does not give)."""

    name: str
    """GPU type."""
    tflops: float
    """Peak dense bf16 TFLOPS (Table 2)."""
    intra_bw: float
    """Measured intra-node (or intra-NUMA) P2P bandwidth, GB/s (Table 2)."""
    cross_bw: float
    """Measured cross-node (or cross-NUMA) P2P bandwidth, GB/s (Table 2)."""
    fabric: str
    """``"nvlink"`` or ``"pcie"`` (Table 2's NVLink column)."""
    cross_links: str
    """Assumed cross-link sharing (Table 2 does not say; see docs/simulator.md)."""
    nics_per_node: int
    """Cross links per node (0: as ``cross_links`` says). Inferred from the paper's own timings
    for H20/H100 (docs/results/sim_validation_paper.md), not from Table 2."""
    gpus: str
    """Default ``m x p`` (Table 2's GPU count as the paper splits it)."""
    mem_bw: float
    """HBM/GDDR bandwidth, GB/s (vendor data sheets), for the cost of merging partial results."""
    efficiency: float
    """Achieved fraction of ``tflops`` in attention blocks, fitted once against the paper (see
    docs/results/sim_validation_paper.md); 0.5 where not fitted."""
    cross_rate: float = 1.0
    """Fraction of ``cross_bw`` that a transfer achieves inside the schedules, where the paper's
    own times give it (H100: Table 5's ring transfers, Note [The paper's baselines] in
    :mod:`megatron_charm.sim.baselines`); 1 where they do not."""
    intra_rate: float = 1.0
    """Fraction of ``intra_bw`` that a transfer achieves inside the schedules, where the paper's
    own times give it (H20: Table 4's ring rows, Note [Constants from the ring rows] in
    :mod:`megatron_charm.sim.ring_rows`); 1 where they do not."""
    enqueue: Enqueue = field(default_factory=lambda: GPU_ENQUEUE)
    """Host seconds to enqueue each device operation (Note [Enqueue ahead] in
    :mod:`megatron_charm.sim.engine`); :data:`GPU_ENQUEUE` for every preset."""
    nvlink: float = 0.0
    """GB/s of one GPU's NVLink ports per direction, which all its intra-node flows share
    (vendor data: NVLink 4, 18 links of 25 GB/s, on H100 SXM and H20: 450); 0: PCIe."""
    sms: int = 0
    """Streaming multiprocessors: the waves a block's tiles run in (Note [Tiles and waves] in
    :mod:`megatron_charm.sim.compute`). H100 SXM: 132 (NVIDIA's Hopper architecture
    whitepaper); L20: 92 (its data sheet's 11,776 CUDA cores over Ada's 128 per SM); H20: 78 (its
    Geekbench 6 listing, as reported; NVIDIA publishes none). 0: no tiles."""
    a2a_rate: float = 0.0
    """Fraction of ``cross_bw`` that each of a node's ``p`` NICs achieves in one step of an
    all-to-all, which spreads a node's cross traffic over every NIC, where the paper's own
    times give it (H100: Table 5's TASP rows, Note [The paper's baselines] in
    :mod:`megatron_charm.sim.baselines`); 0 where they do not: the all-to-all then takes the
    preset's cross links like any transfer."""
    intra_lat: float = ASSUMED_INTRA_LAT
    """Seconds before an intra-node transfer's bytes flow. L20: an assumption; NCCL's own tests
    report about 10 us for their smallest send/recv between two NVLink GPUs (A100), the whole
    operation with its kernel launch (NVIDIA/nccl-tests issue 331). H20: its ring rows; H100:
    the appendix's rise with batch (Note [H100's NVLink fixed cost]). ``--set`` replays
    others."""
    cross_lat: float = 10e-6
    """Seconds before a cross-node transfer's bytes flow: an assumption. NCCL's tests report
    31-34 us for their smallest send/recv between GPUs of two nodes (A40, NVIDIA/nccl-tests
    issue 214)."""
    pcie_domain: float = 0.0
    """GB/s that all PCIe transfers of one node (NUMA domain) share in each direction
    (:attr:`Topology.pcie_domain`, Note [One PCIe domain]); 0: none (NVLink systems)."""
    cross_lat_on_link: bool = False
    """Whether ``cross_lat`` is time on the link (:attr:`Topology.cross_lat_on_link`): H20,
    whose ring rows give a fixed cost of a millisecond per cross transfer (Note [A fixed cost
    on the link]); False where it is a wire latency."""
    paper_error: float = 0.0
    """Largest relative error of this GPU's speedups in the paper's Tables 4 and 5 as the
    preset replays them (validation (a), docs/results/sim_validation_paper.md); ``advise`` quotes
    it as the preset's known error. A test recomputes it from the rows."""

    @property
    def intra_achieved(self) -> float:
        """GB/s of one intra-node transfer inside a schedule: ``intra_bw x intra_rate``."""
        return self.intra_bw * self.intra_rate

    @property
    def cross_achieved(self) -> float:
        """GB/s of one cross-node transfer inside a schedule: ``cross_bw x cross_rate``."""
        return self.cross_bw * self.cross_rate

    def topology(self, num_nodes: int, ranks_per_node: int, **links: object) -> Topology:
        """The preset's links for a ``num_nodes x ranks_per_node`` group; ``links`` override
        ``fabric``, ``cross_links``, ``nics_per_node`` or any other :class:`Topology` field."""
        given: dict = {
            "fabric": self.fabric,
            "cross_links": self.cross_links,
            "nics_per_node": self.nics_per_node,
            "nvlink_egress": self.nvlink,
            "pcie_domain": self.pcie_domain,
            "intra_lat": self.intra_lat,
            "cross_lat": self.cross_lat,
            "cross_lat_on_link": self.cross_lat_on_link,
            **links,
        }
        return Topology(
            num_nodes, ranks_per_node, self.intra_achieved, self.cross_achieved, **given
        )

    def a2a_topology(self, num_nodes: int, ranks_per_node: int) -> Topology:
        """The links an all-to-all of a ``num_nodes x ranks_per_node`` group runs on: one NIC per
        rank at ``cross_bw x a2a_rate`` where :attr:`a2a_rate` is known, else
        :meth:`topology`."""
        if not self.a2a_rate:
            return self.topology(num_nodes, ranks_per_node)
        return dataclasses.replace(
            self.topology(num_nodes, ranks_per_node, cross_links="rails", nics_per_node=0),
            cross_bw=self.cross_bw * self.a2a_rate,
        )

    def compute_model(self, efficiency: float | None = None) -> FlopsCompute:
        """The preset's compute model (``efficiency``: instead of the preset's)."""
        eff = self.efficiency if efficiency is None else efficiency
        return FlopsCompute(
            self.tflops, eff, mem_bw=self.mem_bw, enqueue=self.enqueue, sms=self.sms
        )


#: Host seconds to enqueue one device operation on a GPU host: a kernel call, a merge, a posted
#: exchange, and once per pass. An assumption, between two bounds (docs/simulator.md, "Enqueue
#: ahead"): above a dispatcher call plus a CUDA launch (a few microseconds), below our own
#: executor's host time per instruction at tiny shapes on a CPU host (docs/results/host-per-op.md),
#: which includes the CPU kernel's own work and gloo's copies. ``calibrate --device cuda``
#: measures it on the user's GPUs; ``--enqueue-us`` overrides it.
GPU_ENQUEUE = Enqueue.per_operation(20e-6)


# Note [One PCIe domain]
# ~~~~~~~~~~~~~~~~~~~~~~
# The paper's Figure 1(a) draws a PCIe system's transfers: one alone at full bandwidth, several
# at once at a limited one ("link contention"); its section 3.2 says RM+'s concurrent q and kv
# streams make "the single communication of RM+ ... longer than that in Ring-Attention" there;
# its Table 2 measures one transfer alone (L20: 24.0 GB/s). The L20 preset reads this literally:
# every PCIe transfer of a NUMA domain also crosses one resource per direction (its root complex,
# or the one switch uplink its GPUs share), which carries what one transfer achieves alone:
#
#     GPU0 --+                         ring, one step on 1 x 4: four kv flows, 6 GB/s each
#     GPU1 --+== pcie_up[node]   24 GB/s
#     GPU2 --+== pcie_down[node] 24 GB/s
#     GPU3 --+                         RM+: q and kv streams add bytes (returns), not bandwidth
#
# Cross-NUMA flows take the sender's domain up and the receiver's down, with the NUMA link between.
# With it Table 4's six L20 speedups come within +-25% (+6..+23%; before, three missed by +65%,
# +37% and -32%), at the efficiency the fit then finds: 0.8, the upper end of its search (ring's
# 1 x 4 forward grows 4.4-fold from 1,792 to 7,168 tokens in the replay, 3.94-fold in the
# paper: its L20 blocks are small next to its transfers). It does not fit ring's own times: the
# paper's ring takes 1.9 times as long on two NUMA domains as on one, the replay's 1.1 (four
# flows at 6 GB/s each leave the 14.7 GB/s NUMA link no slower). Which it is on the paper's
# machine, a shared switch uplink or copies through host memory without peer-to-peer, is not
# known; both cost this resource. docs/results/sim_validation_paper.md has the fit and what
# else was tried.

# L20 and H20's efficiencies are the values megatron_charm.sim.validation.fit_efficiency fits on
# the paper's Table 4 with the paper's baselines replayed, searched in [0.2, 0.8] (in [0.02, 0.8]
# before 2026-12-04 12:30 UTC); the command and the fit are in
# docs/results/sim_validation_paper.md.
PRESETS: dict[str, Hardware] = {
    "L20": Hardware(
        "L20",
        119.5,
        24.0,
        14.7,
        "pcie",
        "shared",
        0,
        "2x4",
        864.0,
        EFF_L20,
        sms=92,
        pcie_domain=24.0,
        paper_error=0.08,
    ),
    "H20": Hardware(
        "H20",
        148.0,
        297.2,
        42.6,
        "nvlink",
        "rails",
        4,
        "2x8",
        4000.0,
        EFF_H20,
        H20_CROSS_RATE,
        intra_rate=H20_INTRA_RATE,
        intra_lat=H20_INTRA_LAT,
        cross_lat=H20_CROSS_LAT,
        cross_lat_on_link=True,
        sms=78,
        nvlink=450.0,
        paper_error=0.22,
    ),
    "H100": Hardware(
        "H100",
        989.0,
        365.1,
        42.5,
        "nvlink",
        "rails",
        2,
        "4x8",
        3350.0,
        EFF_H100,
        H100_CROSS_RATE,
        intra_lat=H100_INTRA_LAT,
        sms=132,
        nvlink=450.0,
        a2a_rate=H100_A2A_RATE,
        paper_error=0.09,
    ),
}


def parse_gpus(spec: str) -> tuple[int, int]:
    """``"2x8"`` -> ``(2, 8)`` (nodes, ranks per node); the paper's ``2 × 8`` as well."""
    parts = spec.lower().replace("\u00d7", "x").split("x")
    try:
        m, p = (int(x) for x in parts)
    except ValueError:
        m = p = 0
    if len(parts) != 2 or m < 1 or p < 1:
        raise ValueError(
            f"--gpus {spec!r} is not NODESxRANKS_PER_NODE with positive integers; "
            "write e.g. --gpus 2x8 (2 nodes of 8 GPUs)"
        )
    return m, p
