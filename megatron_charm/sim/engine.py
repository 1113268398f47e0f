"""Event-driven replay of one pass of a plan on a topology and compute model.

Note [Replay semantics]
~~~~~~~~~~~~~~~~~~~~~~~
Every rank is one compute stream that runs its program in order:

* ``Exchange``: posted at the stream's current time (the executor enqueues it behind the work
  before it), never blocks the stream;
* ``Wait``: blocks the stream until the exchange has completed; the blocked time is the rank's
  *exposed communication* (the paper's ``O``);
* ``Compute`` / ``Merge``: occupy the stream for the modelled block / merge time; a block that
  starts while the rank's exchanges in flight hold ``k`` (the compute model's ``held_by``
  summed over them: one each, or a preset's NCCL CTAs) takes the compute model's
  ``slowdown(k)`` times as long (transfers take CPU cores or GPU SMs: measured by a calibrated
  profile, NCCL's CTAs on a preset's SMs, Note [Tiles and waves]; 1 otherwise).

Where every rank runs on one host (a calibrated CPU testbed: the compute model's
``host_slots()`` > 0), ranks also share its cores: Note [Ranks sharing a host].

Communication follows the rule that :func:`megatron_charm.plan.validate.replay` checks symbolically
(NCCL's strict ordering), with time: the exchanges of one rank on one channel run one after another
in posting order (one communicator, one stream), an exchange *starts* when it is posted and its
predecessor on the channel has completed (``Topology.exchange_order="pair"``, as gloo runs them:
when it is posted, and only the transfers between one pair on one channel keep their order, each
starting when the pair's previous one has finished; a run of consecutive exchanges is posted at
its last, Note [Runs posted together]), the ``i``-th send from ``x`` to ``y`` on a
channel meets the ``i``-th receive of ``y`` from ``x`` on it, and that transfer starts when both
sides' exchanges have started. An exchange completes when all its transfers have. Channels run
concurrently and interact only through link resources (:mod:`megatron_charm.sim.topology`). The
symbolic replay couples a whole connected group of matching exchanges into one completion; here each
exchange completes with its own transfers, which is what the GPU kernels do.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from megatron_charm.plan.bulk import collector_paused
from megatron_charm.plan.coalesce import joined_runs, run_goes_on, run_pieces
from megatron_charm.plan.payloads import AttnShape, payload_bytes
from megatron_charm.plan.types import Compute, Exchange, Merge, Payload, Program, Wait, Wire
from megatron_charm.sim.compute import ComputeModel
from megatron_charm.sim.programs import ProgramSet
from megatron_charm.sim.shared_host import SharedHost
from megatron_charm.sim.topology import Topology

_RESUME, _ACTIVATE, _FINISH, _HOSTED, _HOST_END = 0, 1, 2, 3, 4
#: The handles that mark a block's end on the shared host and host work's (Note [Host work of
#: a call] in megatron_charm/sim/profile.py).
_COMPUTE, _HOST_WORK = -1, -2

# Note [Ranks sharing a host]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On the CPU testbed every rank of every emulated node runs on one host: four ranks of one
# thread each on two cores compute at half speed while all four compute, and at full speed while
# two of them wait for a transfer. A fixed block time cannot say both, and whichever the
# calibration measured, it mispredicts the other. So a calibrated CPU profile times each block
# with one rank computing at a time, and records how many ranks the host runs at full speed at
# once (``FittedCompute.shared_slots``: cores over threads per rank). The replay then runs each
# block and merge as a flow of "seconds alone" on one host resource of that capacity, shared
# equally by the ranks computing at that moment (at most full speed each), the same sharing
# that links get (Note [Virtual time on the host] in megatron_charm/sim/shared_host.py):
#
#     ranks computing   1     2     3      4          (2 slots)
#     speed of each     1     1     2/3    1/2
#
# When only one node's ranks are replayed (Note [Node symmetry]) they get their share of the
# host. Profiles of GPUs (each rank its own device) have no slots and keep fixed block times.

# Note [Runs posted together]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On gloo (``exchange_order="pair"``) the runner stages a run of consecutive exchanges and
# posts them all when it reaches the run's last one (Note [Receives of a run first] in
# megatron_charm/comm/executor.py). The replay does the same: each exchange of a run still
# costs its host work where it stands, but its transfers start with the run's last exchange.
# On a first-come link this decides who goes first: an all-to-all's sends to its three peers
# start together and share the link instead of following each other by their posting costs.
# Testbed sweep of 2026-12-05 (on the executor that posts runs so, profile r): a2a's forward
# on 2 x 2 at 200 Mbit/s was predicted up to 22% too fast with each exchange starting where
# it stands, within -2..+6% with the run started together; 190 -> 194 of 196 times within
# +-20%, and 193-194 on a fresh sweep after the change (docs/results/calibrated-2x2.md). NCCL
# (``"channel"``) posts one group per exchange.

# Note [Each side its own size]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A symmetric replay (Note [Node symmetry] in megatron_charm/sim/programs.py) runs node 0 only.
# A cross-node class of transfers then has two sides on node 0 that stand for two different
# transfers: node 0's send to node d, and node 0's receive from node -d (the mirror of node
# d's receive from node 0). Without a mask they are the same size, and one flow on both sides'
# resources replays both exactly. Under causal attention they are not: node 0 holds the
# sequence's first and last halves, so it sends its kv halved to every node above it and
# receives whole kv from them (the zigzag parts), and the nodes above do the reverse.
#
#     one flow, the larger size      node 0's out-link and in-link both carry the whole kv
#     each side its own size         out-link: the halves it sends; in-link: the whole kv
#                                    it receives; each as node 0 carries them in full
#
# So in an approximate replay a matched transfer whose sides name different sizes runs as
# two flows, each from when both sides have posted: the sender's, of its size, counted on the
# sending side's resources, and the receiver's, of its own, on the receiving side's. Each
# ends its own side's operation. A flow also *watches* the other side's resources: it moves no
# faster than their share, without counting on them, since the far end of node 0's send is
# node d's in-link, which by symmetry carries what node 0's own in-link does (a watched link
# with nothing on it gives its whole rate). A link between a pair of nodes (``cross_mesh``)
# has no other end: it gets a copy per side (``pair_out``, ``pair_in``), each carrying its
# side's sizes in full. Causal charm and tasp, whose nodes do not agree on how many transfers
# a class has, run every cross-node transfer unmatched, one side each, in the same way. With
# gloo's order per pair (``exchange_order="pair"``), where a pair's transfers queue as flows
# one after another, a matched transfer keeps one flow of the larger size.
#
# Against full replays (2026-12-07, scripts/bench/symmetric_error.py; tests/sim/test_engine.py
# checks 4 x 4): over 4 x 2, 4 x 4,
# 8 x 2 and 8 x 4 (one NIC per GPU, one shared link, two NICs per node, a PCIe domain) and the
# H100 preset on 4 x 8 and 8 x 8 (8, 2 and 1 NICs per node, 4,096 tokens a rank), the largest
# errors went from charm -21% / -29% (forward / backward), rm+ +18% / +21%, merge's backward
# +31% and all_gather's +18% to charm -13% / -15%, rm+ +5% / +4%, merge's backward +20% (one
# NIC per GPU; +5% on the others) and all_gather's -10%; tasp's backward from -7% to +14%.
# Without the watched links (each flow on its own side's only) they were as large: charm -18%,
# all_gather -20%. On links between pairs of nodes, first come first served (the testbed's),
# from charm -77% and tasp -92% to within 2.3% for every method. On 16 x 8 (H100 preset,
# 262,144 tokens, 16 heads of 128): charm -19% / -16% -> -10% / -9%, merge's backward +31% ->
# +0.6%, rm+ +14% / +23% -> +0.5% / +5.5%, all_gather's backward +10% -> -12%. Node 0 is the
# lowest node, the one that receives whole kv from every other: where its in-link is busy
# longer than a far node's (merge's backward on one NIC per GPU), the watch holds its sends
# back too long.

# Note [Enqueue ahead]
# ~~~~~~~~~~~~~~~~~~~~
# On a GPU the host does not run the pass; it enqueues it. Each kernel call, merge and posted
# exchange costs the host some microseconds (Python, the dispatcher, the launch), and a device
# operation cannot start before the host has enqueued it. Waits on NCCL work are stream waits:
# the host never blocks inside a pass, so the enqueue time of a rank's ``k``-th operation is a
# fixed prefix sum from the pass's start (``Enqueue.call`` plus the costs of operations
# ``0..k``):
#
#     host    |call|e|k|m|e|k|k|m|...                 every op enqueued in program order
#     device        [e ....... ][ k ][m][e ..][ k ]   an op starts at max(stream free, enqueued)
#
# While the device's operations take longer than their enqueue, the host runs ahead and costs
# nothing. On small problems they take less, the pass becomes host-bound, and a schedule with
# more operations loses what its overlap won (on the presets, the smallest of the paper's
# appendix shapes; its gradual rise of the speedup with batch comes from the NVLink fixed cost,
# Note [H100's NVLink fixed cost] in megatron_charm/sim/topology.py). A coalesced run of
# blocks (Note [Coalesced blocks]) is one kernel call, and a summed run of partials one merge
# (Note [Summed partials]). Profiles of one CPU host have no such costs: there the host *is*
# the device, and its work is charged as host work (Note [Host work of a call] in
# megatron_charm/sim/profile.py).


# Note [Rerates batched per instant]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A flow's rate is the smallest share of the resources it crosses, so a flow that starts or ends
# changes the rate of every flow on its resources. Rerating them at each start and end costs
# (flows started together) x (flows on their resources): an all-to-all step of ``n - 1`` peers
# starts ``n - 1`` flows at one instant on resources that carry ``n - 1`` each. ``tasp`` on 16 x 8
# took 4 min 46 s, and 8 x 8 made 129 million rerates. Rates only matter once time moves on:
# ``remaining`` at an instant does not depend on the rate from that instant. So starts and ends
# mark the flows they touch, and the loop rerates each marked flow once before it takes an
# event of a later instant. A flow that ends is unmarked; a rerate would give it a second end.
# The replays are the same to the printed digit: the validation tables, and tasp on 16 x 8,
# whose replay went from 4 min 46 s to 14.5 s (2026-12-07). The validation went from 47 s to 8 s.


# Note [Rerates only where a share binds]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A flow's rate is min(its bandwidth, cap / count over the links it crosses or watches), so a
# start or an end on link ``r`` changes only the flows whose minimum ``r``'s share can move:
#
#     start on r:  share falls to s'    a flow with rate <= s' keeps it (its minimum is elsewhere)
#     end on r:    share rises from s   a flow with rate <  s  keeps it (r was not its minimum)
#
# The rest are marked (Note [Rerates batched per instant]). An unmarked flow's stored rate is
# its true rate at every event of an instant, so the test holds however many links change at
# one instant; a marked flow is rerated with every change of the instant seen. Both sides are
# the same float: a rate bound by ``r`` was computed as ``cap / count`` from the same cached
# capacity. A FIFO link (``cross_fifo``) gives its head flows ``cap / together`` and the others
# nothing, which a count does not tell, so its flows are all marked as before. On ``tasp``'s
# all-to-all steps, whose flows end one by one on NICs that other flows' destinations bind,
# a third of the rerates kept the rate they had.


# Note [Ends pushed back lazily]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rate change moves a flow's end: earlier when the rate rises, later when it falls. An earlier
# end needs a new event (the old one would fire too late). A later one does not: the flow keeps
# its event (``sched``) and notes where its end now is (``due``); when the event fires before
# ``due``, it is pushed again at ``due``. ``due`` is the time an event pushed at the change would
# have had, to the bit, so the replay's times do not change; only the heap holds fewer stale
# events. Rates fall as often as they rise on ``tasp``'s all-to-all steps (687,000 falls and
# 815,000 rises on 4 x 8); each fall pushed an event, and each of those was popped stale.


class Transfer(NamedTuple):
    """One op of an exchange as the replay sees it."""

    key: tuple | None
    """Matching key of the transfer (``None``: runs unmatched, see ``_compile``)."""
    send: bool
    nbytes: int
    resources: tuple
    """Link resources it occupies (:meth:`Topology.resources`)."""
    bandwidth: float
    latency: float
    """Seconds before its bytes flow."""
    held: float = 0.0
    """Bytes its link carries for its fixed cost (:meth:`Topology.held_bytes`)."""


@dataclass
class RankResult:
    """What one rank did during one pass (times in seconds)."""

    cp_rank: int
    finish: float
    """When the rank's last instruction ended."""
    busy: float
    """Time its stream spent in blocks, merges and host work."""
    exposed: float
    """Time its stream was blocked in waits: exposed communication (the paper's ``O``)."""
    idle: float = 0.0
    """``makespan - busy``: exposed communication plus waiting for the slowest rank."""
    bytes_sent: dict[str, int] = field(default_factory=dict)
    """Bytes sent per channel."""
    link_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes sent per link class (``"intra"``, ``"cross"``)."""
    timeline: list[tuple[float, float, str]] = field(default_factory=list)
    """``(start, end, label)`` of every block (``C``), merge (``R``) and wait (``W``)."""
    transfers: list[tuple[float, float, str]] = field(default_factory=list)
    """``(start, end, channel)`` of every exchange of the rank."""
    enqueued: float = 0.0
    """Host seconds to enqueue the rank's whole pass on a GPU (Note [Enqueue ahead]; 0 without
    enqueue costs): the time the device would wait for its host if every operation were free."""


@dataclass
class PassResult:
    """One simulated pass of one method."""

    method: str
    backward: bool
    makespan: float
    ranks: list[RankResult]
    exact: bool
    """False when a symmetric replay of a causal plan approximated the per-node traffic."""
    host_work: float = 0.0
    """Seconds alone of the work the replayed ranks put on the shared host (blocks, merges,
    host work, the transport's threads; Note [Ranks sharing a host]), summed over them; 0
    without a shared host. What the replay charges the CPU, to set against the CPU seconds a
    run measured (scripts/bench/host_cpu_accounting.py)."""

    @property
    def exposed_mean(self) -> float:
        return sum(r.exposed for r in self.ranks) / len(self.ranks)

    @property
    def exposed_max(self) -> float:
        return max(r.exposed for r in self.ranks)

    @property
    def busy_mean(self) -> float:
        return sum(r.busy for r in self.ranks) / len(self.ranks)

    @property
    def enqueued_max(self) -> float:
        """The longest host enqueue time of a simulated rank (:attr:`RankResult.enqueued`)."""
        return max((r.enqueued for r in self.ranks), default=0.0)

    @property
    def idle_mean(self) -> float:
        return sum(r.idle for r in self.ranks) / len(self.ranks)

    def link_bytes(self) -> dict[str, int]:
        """Bytes sent per link class, summed over the simulated ranks."""
        out: dict[str, int] = defaultdict(int)
        for r in self.ranks:
            for k, v in r.link_bytes.items():
                out[k] += v
        return dict(out)


#: Resources that a ``cross_fifo`` topology serves first come, first served (Note [Links and
#: contention] in megatron_charm/sim/topology.py); flows that start within this many seconds of
#: each other count as starting together and share.
_FIFO_LINKS = ("pair", "pair_out", "pair_in", "nic_out", "nic_in")
_TOGETHER = 1e-9

#: Resources on a transfer's sending side; the others are on its receiving side, but for a link
#: between a pair of nodes, which stands for both sides' copies (Note [Each side its own size]).
_SEND_SIDE = frozenset(("pcie_out", "pcie_up", "nvl_out", "nic_out"))


def _one_side(res: tuple, send: bool) -> tuple[tuple, tuple]:
    """``(counted, watched)``: the resources of a flow that carries one side of a transfer
    (``send``: the sender's) in an approximate symmetric replay (Note [Each side its own size]):
    its own side's, where it counts, and the other side's, whose share bounds it."""
    counted, watched = [], []
    for r in res:
        if r[0] == "pair":
            counted.append(("pair_out" if send else "pair_in", r[1]))
        elif (r[0] in _SEND_SIDE) == send:
            counted.append(r)
        else:
            watched.append(r)
    return tuple(counted), tuple(watched)


class _Flow:
    __slots__ = (
        "remaining",
        "rate",
        "last",
        "version",
        "res",
        "bw",
        "ends",
        "pair",
        "born",
        "watch",
        "slots",
        "due",
        "sched",
    )

    def __init__(self, nbytes: float, res: tuple, watch: tuple, bw: float, ends: list) -> None:
        self.remaining = float(nbytes)
        self.rate = bw
        self.last = 0.0
        self.version = 0
        self.res = res
        self.watch = watch  # resources whose share bounds it, where it does not count
        self.bw = bw
        self.ends = ends
        self.pair: tuple | None = None  # (channel, pair) whose transfers keep their order
        self.born = 0.0  # when its bytes started to flow
        # per watched and counted resource, in that order: (capacity, the flows counted on
        # it, the resource if it is a FIFO link else None), set when it activates
        self.slots: tuple = ()
        # when it ends at its rate, and the time of its live end event, which may come
        # earlier (Note [Ends pushed back lazily]); inf: none
        self.due = 0.0
        self.sched = math.inf


class Engine:
    """Replays one pass of a :class:`ProgramSet`; see Note [Replay semantics]."""

    #: Note [Rerates only where a share binds]; False: every flow on a link whose count changed
    #: is rerated, the plain rule that the tests hold the replay to
    filter_rerates = True
    #: Note [Ends pushed back lazily]; False: every rate change pushes the flow's end
    lazy_ends = True

    def __init__(
        self,
        progs: ProgramSet,
        topo: Topology,
        shape: AttnShape,
        compute: ComputeModel,
        backward: bool,
        record: bool = False,
    ) -> None:
        layout = progs.layout
        if (layout.num_nodes, layout.ranks_per_node) != (topo.num_nodes, topo.ranks_per_node):
            raise ValueError(
                f"plan layout {layout.num_nodes}x{layout.ranks_per_node} does not match topology "
                f"{topo.num_nodes}x{topo.ranks_per_node}: programs replay only on the nodes x "
                "ranks per node they were planned for; plan progs with Layout(topo.num_nodes, "
                "topo.ranks_per_node) or pass a topo of the plan's shape"
            )
        self.progs = progs
        self.topo = topo
        self.shape = shape
        self.compute = compute
        self.backward = backward
        self.record = record
        self.host_post = compute.host_work()[1]
        # Note [Where a call's host work runs] in megatron_charm/sim/profile.py
        self.host_call, self.host_rest = compute.host_call_split(shape, backward)
        self.host_byte = compute.host_per_byte()
        self.transport_post, self.transport_byte = compute.transport_work()
        # blocks while their rank's exchanges hold k: slowdown(k), computed once per k
        self.slows = compute.slowdown(backward, 1) != 1.0
        self.slowdowns: dict[int, float] = {}
        enqueue = compute.enqueue_cost()
        self.enqueue = enqueue if enqueue.any and compute.host_slots() == 0 else None
        self.pair_order = topo.exchange_order == "pair"
        programs = progs.backward if backward else progs.forward
        self._capacity: dict[tuple[str, int], float] = {}
        self.host: SharedHost | None = None
        self.host_work = 0.0
        slots = compute.host_slots()
        if slots > 0:  # Note [Ranks sharing a host]
            self.host = SharedHost(slots * len(programs) / layout.cp_size)
        self.cp_ranks = [p.cp_rank for p in programs]
        self.index = {r: i for i, r in enumerate(self.cp_ranks)}
        self.results = [RankResult(r, 0.0, 0.0, 0.0) for r in self.cp_ranks]
        self.instrs = [p.instrs for p in programs]
        self._sizes: dict[tuple, int] = {}
        self._links: dict[tuple[int, int], tuple] = {}
        self._blocks: dict[tuple, float] = {}
        self._merges: dict[Payload, float] = {}
        self._run_savings: dict[tuple, float] = {}
        # each program's runs that one operation does, found once for pricing and enqueueing
        runs = [joined_runs(p.instrs) for p in programs]
        self.costs = [self._compile(p, self.results[i], runs[i]) for i, p in enumerate(programs)]
        # Note [Where a call's host work runs]: the rest of the call's host work, each rank's
        # share per block; the blocks' own costs stay theirs (the in-pass fit reads them)
        self.rest_per_block = [0.0] * len(programs)
        if self.host_rest > 0:
            for i, prog in enumerate(programs):
                blocks = sum(1 for ins in prog.instrs if isinstance(ins, Compute))
                self.rest_per_block[i] = self.host_rest / blocks if blocks else 0.0
        # Note [Enqueue ahead]: when the host has enqueued each instruction (None: no gate)
        self.enqueued = (
            [self._enqueued(p, r) for p, r in zip(programs, runs, strict=True)]
            if self.enqueue
            else None
        )
        if self.enqueued is not None and self.enqueue is not None:
            for res, times in zip(self.results, self.enqueued, strict=True):
                res.enqueued = times[-1] if times else self.enqueue.call

    # -- compilation ----------------------------------------------------------------------------

    def _key(self, channel: str, src: int, dst: int, seq: int) -> tuple:
        sym = self.progs.symmetry
        if sym == "none":
            return (channel, src, dst, seq)
        p, m = self.topo.ranks_per_node, self.topo.num_nodes
        a, b = src // p, dst // p
        dist = (b - a) % m if sym == "shift" else a ^ b
        return (channel, src % p, dst % p, dist, seq)

    def _canon_res(self, res: tuple) -> tuple:
        if self.progs.symmetry == "none":
            return res
        p, k = self.topo.ranks_per_node, self.topo.nics
        # Map the resource to its copy on the simulated node (ranks -> local index, links ->
        # link index within the node, a pair of nodes -> their distance).
        out = []
        for kind, idx in res:
            if kind == "pair":
                m = self.topo.num_nodes
                rails = p if self.topo.cross_links == "rails" else 1
                (a, b), rail = divmod(idx // rails, m), idx % rails
                dist = (b - a) % m if self.progs.symmetry == "shift" else a ^ b
                out.append((kind, dist * rails + rail))
            elif kind in ("pcie_up", "pcie_down"):
                out.append((kind, 0))  # a node's root complex: every node's is the simulated one's
            else:
                out.append((kind, idx % (k if kind.startswith("nic") else p)))
        return tuple(out)

    def _compile(self, prog: Program, rr: RankResult, joined_ops: dict[int, int]) -> list[object]:
        """Per instruction of ``prog``: its transfers (``Exchange``) or its duration (``Compute``,
        ``Merge``); ``None`` for a ``Wait``. The plan's own instructions drive the replay.
        ``joined_ops``: the program's :func:`~megatron_charm.plan.coalesce.joined_runs`."""
        shape, topo, x = self.shape, self.topo, prog.cp_rank
        seq: dict[tuple, int] = defaultdict(int)
        costs: list[object] = []
        # Sizes, link facts and block times repeat across the program: computed once per pass
        # (a block's time depends on its parts, mask and heads only, in every compute model).
        sizes, links, blocks, merges = self._sizes, self._links, self._blocks, self._merges
        exact, unmatched_cross = self.progs.exact, self.progs.unmatched_cross
        # blocks after the first of a coalesced run share its kernel call (Note [Coalesced
        # blocks]): each still takes its FLOPs' time, the call's fixed cost is paid once
        runs = {s: e for s, e in joined_ops.items() if isinstance(prog.instrs[s], Compute)}
        joined = _joined(runs)
        overhead = self.compute.call_overhead(self.backward)
        for index, ins in enumerate(prog.instrs):
            if isinstance(ins, Exchange):
                transfers = []
                for op in ins.ops:
                    src, dst = (x, op.peer) if op.send else (op.peer, x)
                    n = seq[(ins.channel, op.send, op.peer)]
                    seq[(ins.channel, op.send, op.peer)] = n + 1
                    link = links.get((src, dst))
                    if link is None:
                        c = topo.link_class(src, dst)
                        res = self._canon_res(topo.resources(src, dst))
                        bw, lat, held = topo.bandwidth(c), topo.latency(c), topo.held_bytes(c)
                        link = links[(src, dst)] = (c, res, bw, lat, held)
                    cls, res, bw, lat, held = link
                    if op.send or not exact:
                        size_key = (op.payload, op.wire)
                        nbytes = sizes.get(size_key, -1)
                        if nbytes < 0:
                            nbytes = sizes[size_key] = payload_bytes(op.payload, shape, op.wire)
                    if op.send:
                        rr.bytes_sent[ins.channel] = rr.bytes_sent.get(ins.channel, 0) + nbytes
                        rr.link_bytes[cls] = rr.link_bytes.get(cls, 0) + nbytes
                    elif exact:
                        nbytes = 0  # the sender's side sets the size
                    # else: approximate symmetric replay: this side stands for a different copy
                    # of the transfer class than the sender's side (parts differ between nodes
                    # under causal attention): Note [Each side its own size]
                    key = self._key(ins.channel, src, dst, n)
                    if unmatched_cross and not topo.same_node(src, dst):
                        # Approximate symmetric replay of causal charm and tasp: nodes differ in
                        # how many transfers a class has, so a cross-node transfer is not
                        # matched; it runs from when this side's exchange starts (the peer node
                        # is in the same state by symmetry), one side of it
                        key = None
                    transfers.append(Transfer(key, op.send, nbytes, res, bw, lat, held))
                costs.append(tuple(transfers))
            elif isinstance(ins, Compute):
                block_key = (ins.q_part, ins.kv_part, ins.masked, ins.heads)
                took = blocks.get(block_key)
                if took is None:
                    took = blocks[block_key] = self.compute.block_time(ins, shape, self.backward)
                costs.append(took - overhead if index in joined else took)
            elif isinstance(ins, Merge):
                took = merges.get(ins.payload)
                if took is None:
                    nbytes = payload_bytes(ins.payload, shape, Wire.FP32)
                    took = merges[ins.payload] = self.compute.reduce_time(nbytes)
                costs.append(took)
            else:
                costs.append(None)
        self._price_runs(prog, runs, costs)
        return costs

    def _price_runs(self, prog: Program, runs: dict[int, int], costs: list) -> None:
        """Take from each coalesced run's blocks what the run saves as one kernel call (Note
        [Run of blocks, one call] in megatron_charm/sim/compute.py), in proportion to their
        times."""
        for start, end in runs.items():
            run = [c for c in prog.instrs[start:end] if isinstance(c, Compute)]
            # the saving depends on the pieces' parts and head group, not on whose they are
            parts = (*run_pieces(run), run[0].heads)
            saving = self._run_savings.get(parts)
            if saving is None:
                saving = self._run_savings[parts] = self.compute.run_saving(
                    run, self.shape, self.backward
                )
            if saving > 0:
                keep = 1.0 - saving / sum(costs[start:end])
                for i in range(start, end):
                    costs[i] *= keep

    def _enqueued(self, prog: Program, runs: dict[int, int]) -> list[float]:
        """Host time at which each instruction of ``prog`` is enqueued (Note [Enqueue ahead]);
        ``runs``: its :func:`~megatron_charm.plan.coalesce.joined_runs`."""
        enq = self.enqueue
        assert enq is not None
        cost = {None: 0.0, "exchange": enq.exchange, "kernel": enq.kernel, "merge": enq.merge}
        t, out = enq.call, []
        for kind in _operation_kinds(prog, runs):
            t += cost[kind]
            out.append(t)
        return out

    # -- replay ---------------------------------------------------------------------------------

    def run(self) -> PassResult:
        n = len(self.instrs)
        self.heap: list[tuple] = []
        self.tick = 0
        self.pc = [0] * n
        self.waiting: list[int | None] = [None] * n
        self.wait_start = [0.0] * n
        self.remaining_ops: list[dict[int, int]] = [{} for _ in range(n)]
        self.chan_of: list[dict[int, str]] = [{} for _ in range(n)]
        self.ex_start: list[dict[int, float]] = [{} for _ in range(n)]
        self.done: list[set[int]] = [set() for _ in range(n)]
        self.queues: list[dict[str, deque]] = [defaultdict(deque) for _ in range(n)]
        # exchanges in flight per channel (at most one unless exchange_order is "pair")
        self.active: list[dict[str, int]] = [defaultdict(int) for _ in range(n)]
        # exchange_order "pair": whether a pair's transfer is running, and those queued behind it
        self.pair_busy: dict[tuple, bool] = {}
        self.pair_queue: dict[tuple, deque] = defaultdict(deque)
        self.ops_of: list[dict[int, list]] = [{} for _ in range(n)]
        # what each running exchange holds of its rank's compute (ComputeModel.held_by)
        self.held_of: list[dict[int, int]] = [{} for _ in range(n)]
        self.held: list[int] = [0] * n
        self.pending: dict[tuple, tuple] = {}
        # flows per resource, in the order they started: a dict, not a set, so that rerates
        # (and the events they push, ties included) follow the same order in every run; a
        # set's order follows the flows' addresses, which made predictions differ in the
        # fourth digit between runs
        self.res_flows: dict[tuple, dict[_Flow, None]] = defaultdict(dict)
        self.res_watch: dict[tuple, dict[_Flow, None]] = defaultdict(dict)
        # flows whose share changed at ``dirty_at``, rerated once time moves on (Note [Rerates
        # batched per instant])
        self.dirty: dict[_Flow, None] = {}
        self.dirty_at = 0.0
        self.finished = [False] * n
        self.compute_start = [0.0] * n
        self.paid = [False] * n  # the host work of the exchange at pc is done
        # exchange_order "pair": a run's exchanges not yet posted (Note [Runs posted together])
        self.staged: list[list[tuple[Exchange, object]]] = [[] for _ in range(n)]
        for i in range(n):
            if self.host_call > 0:  # the call's own host work, before its first instruction
                self._host_busy(i, self.host_call, 0.0)
            else:
                self._run_rank(i, 0.0)
        heap, dirty = self.heap, self.dirty
        while heap or dirty:
            if dirty and (not heap or heap[0][0] > self.dirty_at):
                self._rerate_dirty()
                continue
            t, _, kind, obj, ver = heapq.heappop(heap)
            if kind == _RESUME:
                self.pc[obj] += 1
                self._run_rank(obj, t)
            elif kind == _HOSTED:
                self._run_rank(obj, t)
            elif kind == _ACTIVATE:
                self._activate(obj, t)
            elif kind == _HOST_END:
                if ver == self.host.version:
                    self._host_end(t)
            elif ver == obj.version:
                if obj.due > t:  # Note [Ends pushed back lazily]: its rate fell since
                    obj.sched = obj.due
                    self._push(obj.due, _FINISH, obj, ver)
                else:
                    self._finish(obj, t)
        stuck = [self.cp_ranks[i] for i in range(n) if not self.finished[i]]
        if stuck:
            raise RuntimeError(f"simulation deadlocked; blocked cp_ranks {stuck[:8]}")
        makespan = max(r.finish for r in self.results)
        for r in self.results:
            r.idle = makespan - r.busy
        return PassResult(
            self.progs.method,
            self.backward,
            makespan,
            self.results,
            self.progs.exact,
            self.host_work,
        )

    def _push(self, t: float, kind: int, obj, ver: int = 0) -> None:
        self.tick += 1
        heapq.heappush(self.heap, (t, self.tick, kind, obj, ver))

    def _run_rank(self, i: int, now: float) -> None:
        instrs, costs, pc, rr = self.instrs[i], self.costs[i], self.pc[i], self.results[i]
        enqueued = self.enqueued[i] if self.enqueued else None
        while pc < len(instrs):
            ins = instrs[pc]
            if enqueued is not None and enqueued[pc] > now and not isinstance(ins, Wait):
                self.pc[i] = pc  # Note [Enqueue ahead]: the device waits for the host
                self._push(enqueued[pc], _HOSTED, i)
                return
            if isinstance(ins, Exchange):
                if (self.host_post > 0 or self.host_byte > 0) and not self.paid[i]:
                    self.paid[i] = True
                    self.pc[i] = pc
                    self._host_busy(i, self.exchange_thread_s(costs[pc]), now)
                    return
                self.paid[i] = False
                if self.pair_order and run_goes_on(instrs, pc):
                    # Note [Runs posted together]: gloo's runner posts a run at its last exchange
                    self.staged[i].append((ins, costs[pc]))
                    pc += 1
                    continue
                for ex, transfers in self.staged[i]:
                    self._post(i, ex, transfers, now)
                self.staged[i].clear()
                self._post(i, ins, costs[pc], now)
                pc += 1
            elif isinstance(ins, Wait):
                if ins.handle in self.done[i]:
                    pc += 1
                    continue
                self.waiting[i] = ins.handle
                self.wait_start[i] = now
                self.pc[i] = pc
                return
            else:
                dur = costs[pc]
                if self.slows:
                    k = self.held[i]
                    if k:  # the rank's transfers share its cores / SMs
                        slow = self.slowdowns.get(k)
                        if slow is None:
                            slow = self.slowdowns[k] = self.compute.slowdown(self.backward, k)
                        dur *= slow
                if self.host_rest and isinstance(ins, Compute):
                    dur += self.rest_per_block[i]
                self.pc[i] = pc
                if self.host is not None:  # Note [Ranks sharing a host]
                    self.compute_start[i] = now
                    self._host_add(dur, ((i, _COMPUTE),), now)
                    return
                rr.busy += dur
                if self.record:
                    rr.timeline.append((now, now + dur, _label(ins)))
                self._push(now + dur, _RESUME, i)
                return
        self.pc[i] = pc
        self.finished[i] = True
        rr.finish = now

    def _post(self, i: int, ex: Exchange, transfers: tuple[Transfer, ...], now: float) -> None:
        self.remaining_ops[i][ex.handle] = len(transfers)
        self.chan_of[i][ex.handle] = ex.channel
        self.held_of[i][ex.handle] = self.compute.held_by(ex) if self.slows else 0
        self.ops_of[i][ex.handle] = transfers
        if self.active[i][ex.channel] and not self.pair_order:
            self.queues[i][ex.channel].append(ex.handle)
        else:
            self._start(i, ex.handle, now)

    def exchange_thread_s(self, transfers: Sequence[Transfer]) -> float:
        """Seconds the rank's own thread spends on an exchange of ``transfers`` before posting
        it (Note [Host work of a call] in megatron_charm/sim/profile.py)."""
        return self.host_post + self.host_byte * sum(t.nbytes for t in transfers if t.send)

    def exchange_transport_s(self, transfers: Sequence[Transfer]) -> float:
        """Seconds the transport's threads spend on an exchange of ``transfers`` while it is in
        flight (Note [Host work of a call])."""
        return self.transport_post + self.transport_byte * sum(
            t.nbytes for t in transfers if t.send
        )

    def _start(self, i: int, handle: int, now: float) -> None:
        self.active[i][self.chan_of[i][handle]] += 1
        self.held[i] += self.held_of[i][handle]
        self.ex_start[i][handle] = now
        if self.host is not None and (self.transport_post > 0 or self.transport_byte > 0):
            # Note [Host work of a call]: the transport's threads take the shared cores while
            # the exchange is in flight; nothing waits for them
            self._host_add(self.exchange_transport_s(self.ops_of[i][handle]), (), now)
        pending = self.pending
        for key, send, nbytes, res, bw, lat, held in self.ops_of[i][handle]:  # Transfer fields
            if key is None:  # unmatched (see _compile)
                flow = _Flow(nbytes + held, *_one_side(res, send), bw, [(i, handle)])
                self._push(now + lat, _ACTIVATE, flow)
                continue
            other = pending.pop(key, None)
            if other is None:
                pending[key] = (i, handle, nbytes)
                continue
            oi, oh, obytes = other
            if obytes != nbytes and not self.progs.exact and not self.pair_order:
                # Note [Each side its own size]
                for side, size, ends in ((send, nbytes, (i, handle)), (not send, obytes, (oi, oh))):
                    flow = _Flow(size + held, *_one_side(res, side), bw, [ends])
                    self._push(now + lat, _ACTIVATE, flow)
                continue
            # both sides of a transfer cross the same link: the same held bytes
            flow = _Flow(max(nbytes, obytes) + held, res, (), bw, [(i, handle), (oi, oh)])
            if self.pair_order:
                flow.pair = key[:-1]  # the key without the transfer's sequence number
                if self.pair_busy.get(flow.pair):
                    self.pair_queue[flow.pair].append((flow, lat))
                    continue
                self.pair_busy[flow.pair] = True
            self._push(now + lat, _ACTIVATE, flow)

    def _activate(self, flow: _Flow, now: float) -> None:
        flow.last = now
        flow.born = now
        if not flow.res and not flow.watch:
            self._push(now + flow.remaining / flow.bw, _FINISH, flow, flow.version)
            return
        dirty = self._mark(now)
        dirty[flow] = None
        for r in flow.res:
            flows = self.res_flows[r]
            flows[flow] = None
            self._mark_on(r, dirty, self._cap(r) / len(flows), rose=False)
        for r in flow.watch:
            self.res_watch[r][flow] = None
        flow.slots = tuple(
            (self._cap(r), self.res_flows[r], r if self._fifo(r) else None)
            for r in (flow.watch + flow.res if flow.watch else flow.res)
        )

    def _cap(self, r: tuple) -> float:
        cap = self._capacity.get(r)
        if cap is None:
            cap = self._capacity[r] = self.topo.capacity(r)
        return cap

    def _fifo(self, r: tuple) -> bool:
        """Whether link ``r`` serves its flows first come, first served."""
        return self.topo.cross_fifo and r[0] in _FIFO_LINKS

    def _mark_on(self, r: tuple, dirty: dict[_Flow, None], share: float, rose: bool) -> None:
        """Mark the flows counted on or watching link ``r`` whose rate its share can move: it
        rose from ``share`` (a flow ended) or fell to it (one started). Note [Rerates only where
        a share binds]; a FIFO link, or the plain rule, marks them all."""
        flows, watch = self.res_flows[r], self.res_watch[r]
        if self._fifo(r) or not self.filter_rerates:
            dirty.update(flows)
            dirty.update(watch)
            return
        for group in (flows, watch):
            if rose:
                for g in group:
                    if g.rate >= share:
                        dirty[g] = None
            else:
                for g in group:
                    if g.rate > share:
                        dirty[g] = None

    def _mark(self, now: float) -> dict[_Flow, None]:
        """The flows to rerate at ``now``, which every flow marked before shares (the loop
        rerates them before time moves on)."""
        assert not self.dirty or self.dirty_at == now, "flows left unrerated"
        self.dirty_at = now
        return self.dirty

    def _rerate_dirty(self) -> None:
        fifo: dict = {}
        now, dirty = self.dirty_at, self.dirty
        for f in dirty:
            self._rerate(f, now, fifo)
        dirty.clear()

    def _fifo_head(self, r: tuple, fifo: dict) -> tuple[float, int]:
        """``(birth of the earliest flow, flows born with it)`` on FIFO link ``r``; ``fifo``
        caches it while a batch of rerates leaves the link's flows unchanged."""
        got = fifo.get(r)
        if got is None:
            flows = self.res_flows[r]
            first = min(x.born for x in flows)
            got = fifo[r] = (first, sum(1 for x in flows if x.born <= first + _TOGETHER))
        return got

    def _rerate(self, f: _Flow, now: float, fifo: dict) -> None:
        left = f.remaining - f.rate * (now - f.last)
        f.remaining = left if left > 0.0 else 0.0
        f.last = now
        rate = f.bw
        for cap, flows, r in f.slots:
            if not flows:  # a watched link with nothing on it (Note [Each side its own size])
                share = cap
            elif r is not None:
                # the earliest flows take the FIFO link; the globally earliest flow is first on
                # every link it crosses or watches, so some flow always moves
                first, together = self._fifo_head(r, fifo)
                if f.born > first + _TOGETHER:
                    rate = 0.0
                    break
                share = cap / together
            else:
                share = cap / len(flows)
            if share < rate:
                rate = share
        if rate == f.rate and f.version:
            return  # its end stays where its event has it: no new event, no stale one
        f.rate = rate
        if rate > 0:
            due = f.due = now + f.remaining / rate
            if due >= f.sched and self.lazy_ends:
                return  # Note [Ends pushed back lazily]: its event comes first and moves on
            f.version += 1
            f.sched = due
            self.tick += 1  # self._push, inlined: the replay's most frequent call
            heapq.heappush(self.heap, (due, self.tick, _FINISH, f, f.version))
        else:
            f.version += 1
            f.sched = math.inf

    def _finish(self, flow: _Flow, now: float) -> None:
        if flow.pair is not None:  # the pair's next transfer may start
            waiting = self.pair_queue[flow.pair]
            if waiting:
                after, lat = waiting.popleft()
                self._push(now + lat, _ACTIVATE, after)
            else:
                self.pair_busy[flow.pair] = False
        if flow.res or flow.watch:
            dirty = self._mark(now)
            for r in flow.res:
                flows = self.res_flows[r]
                share = self._cap(r) / len(flows)  # with this flow still counted
                flows.pop(flow, None)
                self._mark_on(r, dirty, share, rose=True)
            for r in flow.watch:
                self.res_watch[r].pop(flow, None)
            dirty.pop(flow, None)  # done: a rerate would give it a second end
        for i, handle in flow.ends:
            left = self.remaining_ops[i][handle] - 1
            self.remaining_ops[i][handle] = left
            if left == 0:
                self._complete(i, handle, now)

    def _host_busy(self, i: int, seconds: float, now: float) -> None:
        """Rank ``i``'s stream does ``seconds`` of host work, then resumes at its ``pc``."""
        if self.host is not None:  # Note [Ranks sharing a host]
            self.compute_start[i] = now
            self._host_add(seconds, ((i, _HOST_WORK),), now)
            return
        self.results[i].busy += seconds
        if self.record:
            self.results[i].timeline.append((now, now + seconds, "H"))
        self._push(now + seconds, _HOSTED, i)

    def _host_add(self, seconds: float, ends: tuple, now: float) -> None:
        """Start ``seconds`` alone of work on the shared host; ``ends``: ``(i, handle)`` to tell
        when it ends (Note [Virtual time on the host] in megatron_charm/sim/shared_host.py)."""
        host = self.host
        assert host is not None
        self.host_work += seconds
        host.add(seconds, ends, now)
        self._host_next(host, now)

    def _host_end(self, now: float) -> None:
        host = self.host
        assert host is not None
        ends = host.pop(now)
        self._host_next(host, now)
        for i, handle in ends:
            self._host_done(i, now, block=handle == _COMPUTE)

    def _host_next(self, host: SharedHost, now: float) -> None:
        """The event of the host's next end, if a flow is on it (older events go stale)."""
        end = host.next_end(now)
        if end is not None:
            self._push(end, _HOST_END, None, host.version)

    def _host_done(self, i: int, now: float, block: bool) -> None:
        """Rank ``i``'s flow on the shared host has finished: a block or merge (``block``; the
        rank moves past it) or host work (the rank resumes at the same instruction)."""
        rr, start = self.results[i], self.compute_start[i]
        rr.busy += now - start
        if self.record:
            rr.timeline.append((start, now, _label(self.instrs[i][self.pc[i]]) if block else "H"))
        if block:
            self.pc[i] += 1
        self._run_rank(i, now)

    def _complete(self, i: int, handle: int, now: float) -> None:
        self.done[i].add(handle)
        channel = self.chan_of[i][handle]
        if self.record:
            self.results[i].transfers.append((self.ex_start[i][handle], now, channel))
        self.active[i][channel] -= 1
        self.held[i] -= self.held_of[i][handle]
        queue = self.queues[i][channel]
        if queue:
            self._start(i, queue.popleft(), now)
        if self.waiting[i] == handle:
            self.waiting[i] = None
            rr = self.results[i]
            rr.exposed += now - self.wait_start[i]
            if self.record:
                rr.timeline.append((self.wait_start[i], now, f"W {handle}"))
            self.pc[i] += 1
            self._run_rank(i, now)


def _joined(runs: dict[int, int]) -> set[int]:
    """Indices of the instructions that share the operation of the one before them, from a
    program's runs of blocks (Note [Coalesced blocks]) or of blocks and merges
    (:func:`~megatron_charm.plan.coalesce.joined_runs`)."""
    return {i for start, end in runs.items() for i in range(start + 1, end)}


def _operation_kinds(prog: Program, runs: dict[int, int] | None = None) -> list[str | None]:
    """Per instruction of ``prog``, the device operation the host enqueues for it: ``"exchange"``
    (posted), ``"kernel"`` (a call; coalesced blocks after the first share it), ``"merge"`` (a
    summed run of partials is one: Note [Summed partials]), or ``None`` (a wait, a joined block
    or merge). ``runs``: its :func:`~megatron_charm.plan.coalesce.joined_runs`, if known."""
    joined = _joined(joined_runs(prog.instrs) if runs is None else runs)
    kinds: list[str | None] = []
    for index, ins in enumerate(prog.instrs):
        if isinstance(ins, Exchange):
            kinds.append("exchange")
        elif isinstance(ins, Compute):
            kinds.append(None if index in joined else "kernel")
        elif isinstance(ins, Merge):
            kinds.append(None if index in joined else "merge")
        else:
            kinds.append(None)
    return kinds


def enqueued_operations(prog: Program) -> int:
    """Device operations the host enqueues for ``prog`` (Note [Enqueue ahead]): its posted
    exchanges, merges and kernel calls (coalesced blocks share one), the pass's call aside."""
    return sum(kind is not None for kind in _operation_kinds(prog))


def _label(ins: Compute | Merge) -> str:
    if isinstance(ins, Compute):
        return f"C q{ins.q_owner}/kv{ins.kv_owner}"
    return f"M {ins.payload}"


def simulate_pass(
    progs: ProgramSet,
    topo: Topology,
    shape: AttnShape,
    compute: ComputeModel,
    backward: bool = False,
    record: bool = False,
) -> PassResult:
    """Replay the forward (or backward) pass of ``progs``; see Note [Replay semantics]."""
    with collector_paused():  # Note [Pausing the cyclic collector]
        return Engine(progs, topo, shape, compute, backward, record).run()
