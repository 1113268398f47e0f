"""Tensor side of payloads: receive buffers, slicing and accumulators (no communication).

Shapes and precisions come from the plan (:func:`megatron_charm.plan.payloads.payload_tensors`);
this module only maps them onto torch dtypes and devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_charm.kernels import merge_partial
from megatron_charm.plan.layout import part_slice, sub_slice
from megatron_charm.plan.payloads import AttnShape, group_heads, payload_tensors
from megatron_charm.plan.types import Heads, Kind, Part, Payload, Wire

Tensor = torch.Tensor


@dataclass(frozen=True)
class TensorSpace:
    """Where one call's tensors live: the problem shape, the input dtype and the device."""

    shape: AttnShape
    dtype: torch.dtype
    device: torch.device

    def torch_dtype(self, wire: Wire) -> torch.dtype:
        return self.dtype if wire == Wire.INPUT else torch.float32

    def receive_buffers(self, payload: Payload, wire: Wire) -> list[Tensor]:
        """Empty tensors for receiving ``payload`` (``[tokens, b, heads, d]`` each)."""
        return [
            torch.empty(dims, dtype=self.torch_dtype(prec), device=self.device)
            for dims, prec in payload_tensors(
                payload.kind, payload.part, self.shape, wire, payload.heads
            )
        ]


class Accumulator:
    """Partial output ``(out, lse)`` or partial gradients of one owner on one head group (or all
    heads), growing over parts.

    A single block result is kept as the kernel produced it (``single_block``), so that it can
    travel in the input dtype; a second contribution turns it into float32. The accumulators of
    the head groups of one owner are placed side by side by :func:`final_tensors`.
    """

    def __init__(self, kind: Kind, space: TensorSpace, heads: Heads | None = None) -> None:
        self.kind = kind
        self.space = space
        self.heads = heads
        self.part: Part | None = None
        self.tensors: list[Tensor] = []
        self.single_block = False

    def _empty(self, part: Part) -> list[Tensor]:
        shape, device = self.space.shape, self.space.device
        h, h_kv = group_heads(shape, self.heads)
        heads = h_kv if self.kind == Kind.DKV else h
        dims = (shape.tokens(part), shape.b, heads, shape.d)
        if self.kind == Kind.O:
            out = torch.zeros(dims, dtype=torch.float32, device=device)
            lse = torch.full(dims[:3], float("-inf"), dtype=torch.float32, device=device)
            return [out, lse]
        count = 2 if self.kind == Kind.DKV else 1
        return [torch.zeros(dims, dtype=torch.float32, device=device) for _ in range(count)]

    def _to_fp32(self, part: Part) -> None:
        """Make the accumulator float32 and covering ``part``."""
        assert self.part is not None
        if not self.single_block and self.part == part:
            return
        new = self._empty(part)
        sl = sub_slice(part, self.part, self.space.shape.s_local)
        for dst, src in zip(new, self.tensors, strict=True):
            dst[sl].copy_(src)
        self.tensors, self.part, self.single_block = new, part, False

    def add(self, part: Part, tensors: list[Tensor], computed: bool) -> None:
        """Fold in a block result (``computed``) or a received partial covering ``part``."""
        if self.part is None:
            if computed:
                self.part, self.tensors, self.single_block = part, list(tensors), True
            else:
                self.part, self.single_block = part, False
                self.tensors = [t.to(torch.float32, copy=True) for t in tensors]
            return
        self._to_fp32(self.part.union(part))
        sl = sub_slice(self.part, part, self.space.shape.s_local)
        if self.kind == Kind.O:
            merge_partial(self.tensors[0][sl], self.tensors[1][sl], tensors[0], tensors[1])
        else:
            for acc, t in zip(self.tensors, tensors, strict=True):
                acc[sl].add_(t)

    def to_wire(self, wire: Wire) -> list[Tensor]:
        """Tensors to send in the plan's ``wire`` precision (an output's lse stays float32)."""
        assert wire == Wire.INPUT or not self.single_block, "a single block sent in float32"
        tensors = self.tensors
        if wire == Wire.INPUT and not self.single_block:
            keep = 1 if self.kind == Kind.O else len(tensors)
            tensors = [t.to(self.space.dtype) if i < keep else t for i, t in enumerate(tensors)]
        return [t.contiguous() for t in tensors]


def final_tensors(
    accumulators: dict[tuple[Kind, int, Heads | None], Accumulator],
    kind: Kind,
    owner: int,
    dtype: torch.dtype,
) -> list[Tensor]:
    """The finished result of ``kind`` for ``owner``: ``[out [s, b, h, d] in dtype, lse [s, b, h]
    float32]``, ``[dq [s, b, h, d]]`` or ``[dk, dv]`` (``[s, b, h_kv, d]`` each) in ``dtype``.

    Either one accumulator holds all heads, or one per head group holds its heads, which are
    placed side by side along the head dim."""
    groups = {h: a for (k, o, h), a in accumulators.items() if (k, o) == (kind, owner)}
    accs = [groups[None]] if None in groups else [groups[h] for h in sorted(groups, key=_index)]
    out = []
    for i in range(len(accs[0].tensors)):
        lse = kind == Kind.O and i == 1
        pieces = [a.tensors[i] if lse else a.tensors[i].to(dtype) for a in accs]
        out.append(pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=2))
    return out


def _index(heads: Heads | None) -> int:
    assert heads is not None
    return heads.index


def part_of(tensor: Tensor, held: Part, want: Part, length: int) -> Tensor:
    """Restrict a tensor that holds part ``held`` of a ``length``-token sequence to ``want``."""
    return tensor[sub_slice(held, want, length)]


__all__ = ["Accumulator", "TensorSpace", "final_tensors", "part_of", "part_slice"]
