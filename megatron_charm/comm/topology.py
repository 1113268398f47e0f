"""CP topology: node layout of a context-parallel group and one process group per channel.

Note [Channels]
~~~~~~~~~~~~~~~
Each channel is its own process group, so NCCL gives it its own communicator and stream, and gloo
its own connections: kv traffic, q traffic and returned results never queue behind each other::

    scope   groups                               channels
    full    the CP group                         full.kv  full.q  full.o    (ring, merge, rm+)
    intra   the p ranks of each node             intra.kv intra.q intra.o   (charm)
    cross   the m ranks with one local index     cross.q  cross.o           (charm)

"Node" means a block of ``ranks_per_node`` consecutive CP ranks. With one node the intra groups are
the full groups.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_charm.constants import DEFAULT_TIMEOUT
from megatron_charm.plan import CHANNELS, Layout

log = logging.getLogger(__name__)


def layout_from_nodes(node_ids: list[str], ranks_per_node: int | None) -> Layout:
    """Node layout from the node identity of each CP rank (pure; raises ``ValueError``)."""
    cp_size = len(node_ids)
    if ranks_per_node is not None:
        if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool):
            raise ValueError(
                f"ranks_per_node={ranks_per_node!r} must be an integer (or None to detect nodes)"
            )
        if ranks_per_node < 1 or cp_size % ranks_per_node != 0:
            raise ValueError(
                f"ranks_per_node={ranks_per_node} must be >= 1 and divide the CP size {cp_size}; "
                "pass a divisor of the context-parallel size as the ranks_per_node= argument "
                "(in the Megatron integration: charm ranks_per_node / --charm-ranks-per-node, "
                "whose default is MEGATRON_CHARM_RANKS_PER_NODE)"
            )
        return Layout(cp_size // ranks_per_node, ranks_per_node)
    blocks: list[tuple[str, int]] = []
    for nid in node_ids:
        if blocks and blocks[-1][0] == nid:
            blocks[-1] = (nid, blocks[-1][1] + 1)
        else:
            blocks.append((nid, 1))
    names = [b[0] for b in blocks]
    if len(set(names)) != len(names):
        raise ValueError(
            f"CP ranks of one node are not contiguous (node per CP rank: {node_ids}); order the "
            "ranks so each node holds consecutive CP ranks, or set ranks_per_node explicitly"
        )
    sizes = {b[1] for b in blocks}
    if len(sizes) != 1:
        raise ValueError(
            f"detected nodes hold unequal numbers of CP ranks: {dict(blocks)}; CHARM+ needs equal "
            "nodes. Launch the same number of ranks per node or set ranks_per_node explicitly"
        )
    return Layout(len(blocks), sizes.pop())


@dataclass
class CPTopology:
    """A CP group, its node layout and its channel process groups. Build with :meth:`build`."""

    cp_group: dist.ProcessGroup
    cp_rank: int
    cp_size: int
    global_ranks: list[int]
    layout: Layout
    backend: str
    timeout: timedelta
    channels: dict[str, dist.ProcessGroup | None] = field(repr=False, default_factory=dict)
    control: dist.ProcessGroup | None = field(repr=False, default=None)
    """A gloo group over the CP ranks for the per-call checks (Note [Call agreement] in
    :mod:`megatron_charm.comm.agreement`): they run in host memory, so that a CUDA job's host
    never waits for its GPU to drain. Built by :meth:`build` whatever the CP backend."""
    groups_per_node: int = 1
    """CP groups with a rank on this rank's node (its node identity, as :meth:`build` detects
    it): this one and, in a Megatron job, those of the other tensor-parallel ranks and of the
    data-parallel replicas on the node. ``auto`` counts them as sharing the node's links (Note
    [Groups sharing a node] in :mod:`megatron_charm.sim.node_groups`)."""
    _busy: threading.Lock = field(repr=False, default_factory=threading.Lock)
    _destroyed: bool = field(repr=False, default=False)

    @property
    def num_nodes(self) -> int:
        return self.layout.num_nodes

    @property
    def receives_first_in_runs(self) -> bool:
        """Whether the executor posts every receive of a run of exchanges before any of their
        sends: on gloo, which issues ops in posting order (Note [Receives of a run first] in
        :mod:`megatron_charm.comm.executor`); elsewhere each exchange is one group."""
        return self.backend == "gloo"

    @property
    def ranks_per_node(self) -> int:
        return self.layout.ranks_per_node

    def describe(self) -> str:
        lay = self.layout
        return (
            f"CP group of {self.cp_size} ranks (global ranks {self.global_ranks}), {lay.num_nodes} "
            f"node(s) x {lay.ranks_per_node} rank(s), backend {self.backend}, "
            f"{len({id(g) for g in self.channels.values() if g is not None})} channel groups"
            + (f", {self.groups_per_node} CP groups per node" if self.groups_per_node > 1 else "")
        )

    def channel(self, name: str) -> dist.ProcessGroup:
        group = self.channels.get(name)
        if group is None:
            raise AssertionError(f"channel {name} has no process group on cp_rank {self.cp_rank}")
        return group

    @classmethod
    def build(
        cls,
        cp_group: dist.ProcessGroup | None = None,
        ranks_per_node: int | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        node_id: str | None = None,
    ) -> CPTopology:
        """Derive the layout and create the channel groups.

        Collective over the default group: every rank of the job calls it, in the same order,
        because every channel group of every CP group is created on all ranks.

        Args:
            cp_group: the context-parallel group (``None``: the whole job).
            ranks_per_node: CP ranks per node; ``None`` detects it from node identities
                gathered over the CP group.
            timeout: timeout of every channel group; after it a dead peer raises (gloo) or
                NCCL's watchdog ends the process (docs/launchers.md, "NCCL: what differs").
            node_id: this rank's node identity; ``None``: the hostname. No environment
                variable is read here: entry points pass ``node_id=`` from
                :func:`megatron_charm.env.node_id` (``MEGATRON_CHARM_NODE_ID``, which the
                testbed sets per emulated node, else the hostname).
        """
        if not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialized; call torch.distributed.init_process_group "
                "(or launch with torchrun) before CPTopology.build"
            )
        group = cp_group if cp_group is not None else dist.group.WORLD
        cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
        if cp_rank < 0:
            raise ValueError(
                f"global rank {dist.get_rank()} is not a member of the CP group it passed to "
                "CPTopology.build (ranks "
                f"{dist.get_process_group_ranks(group)}); pass this rank's own CP group"
            )
        global_ranks = dist.get_process_group_ranks(group)
        backend = str(dist.get_backend(group))
        ids: list[str | None] = [None] * cp_size
        node = node_id if node_id is not None else socket.gethostname()
        dist.all_gather_object(ids, node, group=group)
        try:
            layout = layout_from_nodes([str(i) for i in ids], ranks_per_node)
            err = ""
        except ValueError as exc:
            layout, err = Layout(1, cp_size), str(exc)
        # Every rank learns every CP group's layout, so all ranks create all groups in one order.
        everyone: list[tuple | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (tuple(global_ranks), layout.ranks_per_node, err, node))
        errors = sorted({e[2] for e in everyone if e and e[2]})
        if errors:
            raise ValueError(errors[0])
        splits: dict[tuple, set[int]] = {}
        for e in everyone:
            if e:
                splits.setdefault(e[0], set()).add(e[1])
        disagree = {ranks: sorted(p) for ranks, p in splits.items() if len(p) > 1}
        if disagree:
            ranks, values = next(iter(disagree.items()))
            raise ValueError(
                f"ranks of the CP group {list(ranks)} build their topology with different "
                f"ranks_per_node {values}; every rank must pass the same ranks_per_node (or None "
                "on all ranks to detect nodes)"
            )
        groups = sorted({(e[0], e[1]) for e in everyone if e})
        mine: dict[str, dist.ProcessGroup | None] = {}
        control = None
        for ranks, p in groups:
            made = _make_channel_groups(list(ranks), p, backend, timeout)
            # the CP ranks' gloo group of the per-call checks (Note [Call agreement])
            made_control = dist.new_group(list(ranks), timeout=timeout, backend="gloo")
            if tuple(global_ranks) == ranks:
                mine, control = made, made_control
        _warm_up(mine, backend)
        # the CP groups with a rank on this node, this one among them (Note [Groups sharing a
        # node]): one host that emulates several nodes with an explicit ranks_per_node still
        # holds one group
        sharing = len({e[0] for e in everyone if e and e[3] == node})
        topo = cls(
            group, cp_rank, cp_size, global_ranks, layout, backend, timeout, mine, control, sharing
        )
        if dist.get_rank() == global_ranks[0]:
            log.info("megatron-charm topology: %s", topo.describe())
        return topo

    def destroy(self) -> None:
        """Destroy the process groups that :meth:`build` created for this rank: its channel groups
        and its control group. The CP group is the caller's and stays.

        Every rank of the CP group calls it, after its last call on this topology (on NCCL a
        group's destruction is collective among its members). A topology that is built again
        and again in one process (a sweep, a notebook) otherwise keeps every earlier one's
        groups: on gloo each holds sockets to its peers until the process ends (Note [Groups of
        a run] in :mod:`megatron_charm.train.launch`). A call on a destroyed topology raises
        ``ValueError``; destroying it twice, or after the job's ``destroy_process_group()``,
        does nothing.
        """
        if self._destroyed:
            return
        with self.exclusive():
            self._destroyed = True
            made = (*self.channels.values(), self.control)
            # the intra-node channels of one node are the full ones, not copies: each once
            destroy_groups({id(g): g for g in made if g is not None}.values())
            self.channels = {}
            self.control = None

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """One call at a time: the channel groups match exchanges by posting order, so two threads
        interleaving their exchanges on one topology would silently mix their data. Raise
        instead; ``cp_attention`` is not thread-safe per topology (build one per thread)."""
        self._check_alive()
        if not self._busy.acquire(blocking=False):
            raise ValueError(
                f"cp_attention is already running on this CPTopology (cp_rank {self.cp_rank}) in "
                "another thread; calls on one topology must not overlap. Serialise them, or give "
                "each thread its own CPTopology.build"
            )
        try:
            yield
        finally:
            self._busy.release()

    def _check_alive(self) -> None:
        if self._destroyed:
            raise ValueError(
                f"this CPTopology (cp_rank {self.cp_rank}) was destroyed and has no process "
                "groups left; build a new one with CPTopology.build"
            )

    def check_device(self, device: torch.device) -> None:
        """Raise ``ValueError`` when this topology cannot move tensors on ``device``: its
        backend does not serve the device, or it was destroyed."""
        self._check_alive()
        ok = {"gloo": ("cpu",), "nccl": ("cuda",)}.get(self.backend)
        if ok is not None and device.type not in ok:
            raise ValueError(
                f"tensors on device {device} cannot be communicated by the CP group's "
                f"{self.backend} backend (it serves {', '.join(ok)}); move q, k, v to "
                f"{ok[0]} or build the CP group with a backend for {device.type}"
            )


def live_process_groups() -> set[dist.ProcessGroup] | None:
    """The process groups this process holds; ``None`` where torch does not say. torch lists
    them only in a private map, which another version may lack."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = getattr(world, "pg_map", None)
    return None if groups is None else set(groups)


def destroy_groups(groups: Iterable[dist.ProcessGroup]) -> None:
    """Destroy each of ``groups`` that this process still holds. One that is gone already
    (``destroy_process_group()`` of the whole job) is skipped: torch would raise."""
    live = live_process_groups() if dist.is_initialized() else set()
    for group in groups:
        if live is None or group in live:
            dist.destroy_process_group(group)


def channel_groups(layout: Layout) -> dict[str, list[tuple[int, ...]]]:
    """CP ranks of every process group of every channel, in creation order (pure).

    Note [Channels]: ``full`` channels have one group of all ranks; ``intra`` channels one group
    per node (the full groups themselves with one node); ``cross`` channels one group per local
    index when there are several nodes.
    """
    n, p, m = layout.cp_size, layout.ranks_per_node, layout.num_nodes
    out: dict[str, list[tuple[int, ...]]] = {}
    for name, scope in CHANNELS.items():
        if scope == "full" or (scope == "intra" and m == 1):
            out[name] = [tuple(range(n))]
        elif scope == "intra":
            out[name] = [tuple(range(node * p, (node + 1) * p)) for node in range(m)]
        elif scope == "cross" and m > 1:
            out[name] = [tuple(node * p + local for node in range(m)) for local in range(p)]
    return out


def warm_pairs(layout: Layout) -> set[tuple[str, int, int]]:
    """``(channel, cp_rank a, cp_rank b)`` with ``a < b`` for every pair that the warm-up
    connects: every pair of every channel group (pure)."""
    return {
        (name, a, b)
        for name, groups in channel_groups(layout).items()
        for members in groups
        for i, a in enumerate(members)
        for b in members[i + 1 :]
    }


def _warm_up(channels: dict[str, dist.ProcessGroup | None], backend: str) -> None:
    """Connect every channel group: one collective, then one exchange with every other member.

    Note [Warm-up]
    ~~~~~~~~~~~~~~
    NCCL creates a communicator at its first operation, which must involve every member: the
    ``all_reduce`` does that. It then connects two ranks lazily, at their first send/recv, and
    the host blocks in ``ncclGroupEnd`` until the peer makes its first exchange with it on that
    communicator; plans order their exchanges for the transfers, not for first contacts, and
    many would hang (Note [First contact] in :mod:`megatron_charm.plan.validate`). So each group
    also runs one ``batch_isend_irecv`` with every other member, which connects all its pairs at
    once. Groups go in channel-name order, the same on every rank: the members of a group reach
    it at the same position, so no rank waits on a peer that waits elsewhere. Each rank sends
    its group rank, and checks what it receives, so a broken link fails here and not in the
    middle of a step. Gloo runs the same code.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    seen: set[int] = set()
    for name in sorted(channels):
        group = channels[name]
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        dist.all_reduce(torch.ones(1, device=device), group=group)
        me, size = dist.get_rank(group), dist.get_world_size(group)
        peers = [r for r in range(size) if r != me]
        if not peers:
            continue
        sent = torch.full((1,), me, dtype=torch.int64, device=device)
        got = {r: torch.full((1,), -1, dtype=torch.int64, device=device) for r in peers}
        # receives before sends, as the executor posts them (Note [Receives first] in
        # megatron_charm/comm/executor.py)
        recvs, sends = [], []
        for r in peers:
            peer = dist.get_global_rank(group, r)
            recvs.append(dist.P2POp(dist.irecv, got[r], peer, group))
            sends.append(dist.P2POp(dist.isend, sent, peer, group))
        for work in dist.batch_isend_irecv(recvs + sends):
            work.wait()
        wrong = {r: int(t.item()) for r, t in got.items() if int(t.item()) != r}
        if wrong:
            raise AssertionError(f"channel {name} warm-up: got {wrong} from group ranks")


def _make_channel_groups(
    ranks: list[int], p: int, backend: str, timeout: timedelta
) -> dict[str, dist.ProcessGroup | None]:
    """Create every channel group of the CP group of global ``ranks`` (collective over the
    default group: every rank creates every group, in :func:`channel_groups` order) and return
    this rank's, with ``timeout`` on each."""
    me = dist.get_rank()
    layout = Layout(len(ranks) // p, p)
    out: dict[str, dist.ProcessGroup | None] = {}
    for name, groups in channel_groups(layout).items():
        if CHANNELS[name] == "intra" and layout.num_nodes == 1:
            out[name] = out.get(name.replace("intra", "full"))  # the same group, not a copy
            continue
        for cp_ranks in groups:
            members = [ranks[x] for x in cp_ranks]
            g = dist.new_group(members, timeout=timeout, backend=backend)
            if me in members:
                out[name] = g
    return out
