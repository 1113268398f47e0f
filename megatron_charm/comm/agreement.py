"""Every call checks that all CP ranks run the same problem with the same plan.

Note [Call agreement]
~~~~~~~~~~~~~~~~~~~~~
Ranks that disagree on a shape, a dtype or a plan option post exchanges that do not match: gloo
may then accept a short message into a larger buffer, or abort inside a native call, and NCCL may
hang. So before any exchange is posted, every call reduces a 63-bit fingerprint of its
:class:`CallKey` over the CP ranks: one all_reduce (MIN) of ``[fingerprint, -fingerprint]``
gives the smallest and the largest, and the ranks agree when they are equal. Only when they
differ do the ranks gather the keys themselves, so that every rank raises the same
``ValueError`` naming the fields that differ. The check runs on every call, not once per
shape: a rank that changes shape after a good first call is caught at that call.

Its cost is latency, paid before the pass's first exchange: on a CPU host it is the pass's own
time, on a GPU host it delays the enqueue. An all_gather of the fingerprints (until 2026-12-06)
took 1.5-2.6 ms among four testbed ranks on two cores, 6.7-7.9 among eight and 22-23 among
sixteen (10-20 ms at the start of a real pass on eight); the all_reduce takes 0.8-0.9, 2.0-2.9
and 5.4-6.0 ms (docs/results/call-agreement-2026-12-06.md).

The fingerprints travel in host memory, over the topology's own gloo group
(``CPTopology.control``), whatever the CP group's backend. Gathered on the GPU, reading them
back (``.item()``) would make the host wait until the GPU had run everything queued before the
call: once per attention layer, the host could no longer run ahead of the GPU, and the GPU would
idle while the host prepared the call's first kernels. On the host the check costs one small
gloo exchange and leaves the GPU's queue alone. Gloo jobs run the same code::

    host:  fingerprint -> gloo all_reduce (control group) -> compare -> post exchanges, kernels
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
        """A 63-bit non-negative hash: its negation fits an int64 (:func:`check_agreement`)."""
        return _hash63(repr(self))

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
    mine = key.fingerprint() ^ hash_layout(topo)
    # One all_reduce, not an all_gather of cp_size tiny tensors: a third of the time among
    # eight testbed ranks, a quarter among sixteen (Note [Call agreement]).
    extremes = torch.tensor([mine, -mine], dtype=torch.int64)
    try:
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN, group=topo.control)
    except RuntimeError as exc:
        raise DistributedError(
            f"cp_rank {topo.cp_rank} could not agree on shapes and options with its CP group: "
            f"{exc}. A peer rank died or timed out (timeout {topo.timeout})"
        ) from exc
    if agreed(int(extremes[0]), int(extremes[1])):
        return
    everyone: list = [None] * topo.cp_size
    dist.all_gather_object(everyone, full, group=topo.control)
    raise ValueError(_mismatch_message(everyone))


def agreed(smallest: int, minus_largest: int) -> bool:
    """Whether every rank's fingerprint is the same, from the group's MIN-reduction of
    ``[fingerprint, -fingerprint]``: the smallest equals the largest."""
    return smallest == -minus_largest


def hash_layout(topo: CPTopology) -> int:
    return _hash63(f"{topo.layout.num_nodes}x{topo.layout.ranks_per_node}")


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


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
