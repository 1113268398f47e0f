"""Every call checks that all CP ranks run the same problem with the same plan.

Note [Call agreement]
~~~~~~~~~~~~~~~~~~~~~
Ranks that disagree on a shape, a dtype or a plan option post exchanges that do not match: gloo
may then accept a short message into a larger buffer, or abort inside a native call, and NCCL may
hang. So every call gathers one 64-bit fingerprint of its :class:`CallKey` (one tiny collective
over the CP ranks) before any exchange is posted. Only when the fingerprints differ do the ranks
gather the keys themselves, so that every rank raises the same ``ValueError`` naming the fields
that differ. The check runs on every call, not once per shape: a rank that changes shape after a
good first call is caught at that call.

The fingerprints travel in host memory, over the topology's own gloo group
(``CPTopology.control``), whatever the CP group's backend. Gathered on the GPU, reading them
back (``.item()``) would make the host wait until the GPU had run everything queued before the
call: once per attention layer, the host could no longer run ahead of the GPU, and the GPU would
idle while the host prepared the call's first kernels. On the host the check costs one small
gloo exchange and leaves the GPU's queue alone. Gloo jobs run the same code::

    host:  fingerprint -> gloo all_gather (control group) -> compare -> post exchanges, kernels
    GPU:   ...earlier layers' kernels keep running...   ->  this call's exchanges, kernels
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from megatron_charm.comm.executor import DistributedError
from megatron_charm.comm.topology import CPTopology
from megatron_charm.plan.options import PlanOptions


@dataclass(frozen=True)
class CallKey:
    """What every CP rank of one call must agree on."""

    local_shape_sbhd: tuple[int, ...]
    """q's local shape as ``[s_local, b, h, d]``."""
    kv_heads: int
    dtype: str
    causal: bool
    softmax_scale: float
    options: PlanOptions
    mask: str = ""
    """Fingerprint of the document mask (``""``: none)."""

    def fingerprint(self) -> int:
        digest = hashlib.blake2b(repr(self).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def describe(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_agreement(topo: CPTopology, key: CallKey) -> None:
    """Raise ``ValueError`` on every rank when the CP ranks' keys (or layouts) differ.

    Collective over ``topo.control``, in host memory; see Note [Call agreement].
    """
    if topo.cp_size == 1:
        return
    assert topo.control is not None, "CPTopology.build creates the control group"
    full = (key, topo.layout)
    mine = torch.tensor([key.fingerprint() ^ hash_layout(topo)], dtype=torch.int64)
    got = [torch.empty_like(mine) for _ in range(topo.cp_size)]
    try:
        dist.all_gather(got, mine, group=topo.control)
    except RuntimeError as exc:
        raise DistributedError(
            f"cp_rank {topo.cp_rank} could not agree on shapes and options with its CP group: "
            f"{exc}. A peer rank died or timed out (timeout {topo.timeout})"
        ) from exc
    if len({int(t.item()) for t in got}) == 1:
        return
    everyone: list = [None] * topo.cp_size
    dist.all_gather_object(everyone, full, group=topo.control)
    raise ValueError(_mismatch_message(everyone))


def hash_layout(topo: CPTopology) -> int:
    text = f"{topo.layout.num_nodes}x{topo.layout.ranks_per_node}"
    return int.from_bytes(
        hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True
    )


def _mismatch_message(everyone: list) -> str:
    first_key, first_layout = everyone[0]
    diffs = []
    for cp_rank, (key, layout) in enumerate(everyone):
        if layout != first_layout:
            diffs.append(f"cp_rank {cp_rank}: node layout {layout} vs {first_layout} on cp_rank 0")
        a, b = key.describe(), first_key.describe()
        for name in a:
            if a[name] != b[name]:
                diffs.append(f"cp_rank {cp_rank}: {name}={a[name]!r} vs {b[name]!r} on cp_rank 0")
    return (
        "CP ranks call cp_attention with different shapes, settings or plan options: "
        + "; ".join(diffs)
        + ". Every rank of the CP group must hold the same local sequence length (q as "
        "[s_local, b, h, d]), dtype and plan options (every PlanOptions field)"
    )
