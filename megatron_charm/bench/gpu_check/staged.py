"""A test-only transport: gloo point-to-point with device tensors staged through host memory.

gloo moves CPU tensors only. To run CP on CUDA tensors over gloo (several processes on one GPU,
where NCCL may refuse to run), every exchange of the executor goes through :class:`StagedDist`:
each sent tensor is copied to a (pinned, on CUDA) host buffer before the gloo send is posted, and
each received host buffer is copied into the executor's device tensor when the exchange's work is
waited on. Compute stays on the device; only the exchanges move through the host.

The executor (:mod:`megatron_charm.comm.executor`) reaches torch.distributed through its module
attribute ``dist``; :func:`install` replaces that attribute with a :class:`StagedDist` in this
process. Nothing in the library knows about it. Host copies are synchronous, so this transport
shows correctness, not overlap.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor


class _Op:
    """What the executor builds with ``dist.P2POp``: kept until ``batch_isend_irecv`` stages it."""

    def __init__(self, op: Any, tensor: Tensor, peer: int, group: Any = None) -> None:
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group


class _StagedWork:
    """The gloo works of one exchange; ``wait`` copies the received host buffers to the device.

    It holds every host buffer (sent and received) until the wait, since gloo reads and writes
    them asynchronously.
    """

    def __init__(self, works: list, sent: list[Tensor], received: list[tuple[Tensor, Tensor]]):
        self.works, self.sent, self.received = works, sent, received

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        for device_tensor, host in self.received:
            device_tensor.copy_(host)
        self.sent, self.received = [], []
        return True


class StagedDist:
    """Stands in for ``torch.distributed`` in the executor; everything but point-to-point passes
    through unchanged."""

    P2POp = _Op

    def __init__(self) -> None:
        self.exchanges = 0
        """Exchanges staged so far (the check reports it, to show the transport was in use)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def _host(t: Tensor) -> Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)

    def batch_isend_irecv(self, ops: list[_Op]) -> list[_StagedWork]:
        """Post ``ops`` on gloo with host copies; one work that finishes them all."""
        self.exchanges += 1
        real, sent, received = [], [], []
        for op in ops:
            host = self._host(op.tensor)
            if op.op is dist.isend:
                host.copy_(op.tensor)  # synchronous: the device tensor is final when posted
                sent.append(host)
            else:
                received.append((op.tensor, host))
            real.append(dist.P2POp(op.op, host, op.peer, op.group))
        return [_StagedWork(dist.batch_isend_irecv(real), sent, received)]


def install() -> StagedDist:
    """Route this process's executor exchanges through a :class:`StagedDist` (test-only)."""
    from megatron_charm.comm import executor

    staged = StagedDist()
    executor.dist = staged  # type: ignore[assignment]
    return staged


def uninstall() -> None:
    """Give the executor torch.distributed back."""
    from megatron_charm.comm import executor

    executor.dist = dist


def allow_device(topo: Any) -> None:
    """Let a gloo ``CPTopology`` take device tensors (its exchanges are staged by
    :func:`install`); without this, ``cp_attention`` refuses CUDA tensors on gloo."""
    topo.check_device = lambda device: None
