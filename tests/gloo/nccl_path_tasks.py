"""Rank tasks for tests/gloo/test_nccl_path.py (see :mod:`tests.rank_pool`)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def warm_up_contacts(ctx, ranks_per_node: int, timeout_s: float):
    """Build a topology while recording the warm-up's exchanges.

    Returns this rank's cp_rank, the ``(channel, peer cp_rank, send)`` ops the build posted, and
    the timeout of every channel group as the groups report it.
    """
    import megatron_charm as mc

    posted: list[tuple[int, int, bool]] = []  # (id of the group, global peer, send)
    real = dist.batch_isend_irecv

    def recording(ops):
        posted.extend((id(op.group), op.peer, op.op is dist.isend) for op in ops)
        return real(ops)

    dist.batch_isend_irecv = recording
    try:
        topo = mc.CPTopology.build(
            None, ranks_per_node=ranks_per_node, timeout=timedelta(seconds=timeout_s)
        )
    finally:
        dist.batch_isend_irecv = real
    names: dict[int, str] = {}
    for name in sorted(topo.channels):
        group = topo.channels[name]
        if group is not None:
            names.setdefault(id(group), name)  # an alias shares the first name's group
    cp_of = {g: x for x, g in enumerate(topo.global_ranks)}
    ops = sorted((names[g], cp_of[peer], send) for g, peer, send in posted)
    timeouts = {
        name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for name, group in topo.channels.items()
        if group is not None
    }
    return topo.cp_rank, ops, timeouts
