"""Tensor side of payloads: shapes, slicing and accumulators (no communication)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_charm.kernels import merge_partial
from megatron_charm.plan.cost import INPUT, AttnShape, payload_tensors
from megatron_charm.plan.layout import part_slice, sub_slice
from megatron_charm.plan.types import Kind, Part, Payload

Tensor = torch.Tensor


@dataclass(frozen=True)
class Dims:
    """Local sizes of one call: ``s`` local tokens, batch ``b``, ``h``/``h_kv`` heads, dim ``d``."""

    s: int
    b: int
    h: int
    h_kv: int
    d: int
    dtype: torch.dtype
    device: torch.device

    def part_len(self, part: Part) -> int:
        return self.s if part == Part.FULL else self.s // 2


def payload_specs(p: Payload, dims: Dims, raw: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the tensors of payload ``p`` (``raw``: partial in the input dtype)."""
    shape = AttnShape(dims.b, dims.s, dims.h, dims.h_kv, dims.d)
    return [
        (sizes, dims.dtype if prec == INPUT else torch.float32)
        for sizes, prec in payload_tensors(p.kind, dims.part_len(p.part), shape, raw)
    ]


class Accumulator:
    """Partial output ``(out, lse)`` or partial gradients of one owner, growing over parts.

    A single block result is kept as the kernel produced it (``raw``), so that it can travel in the
    input dtype; a second contribution turns it into float32.
    """

    def __init__(self, kind: Kind, dims: Dims) -> None:
        self.kind = kind
        self.dims = dims
        self.part: Part | None = None
        self.tensors: list[Tensor] = []
        self.raw = False

    def _empty(self, part: Part) -> list[Tensor]:
        n = self.dims.part_len(part)
        d = self.dims
        heads = d.h_kv if self.kind == Kind.DKV else d.h
        shape = (n, d.b, heads, d.d)
        if self.kind == Kind.O:
            out = torch.zeros(shape, dtype=torch.float32, device=d.device)
            lse = torch.full(shape[:3], float("-inf"), dtype=torch.float32, device=d.device)
            return [out, lse]
        count = 2 if self.kind == Kind.DKV else 1
        return [torch.zeros(shape, dtype=torch.float32, device=d.device) for _ in range(count)]

    def _to_fp32(self, part: Part) -> None:
        """Make the accumulator float32 and covering ``part``."""
        assert self.part is not None
        if not self.raw and self.part == part:
            return
        new = self._empty(part)
        sl = sub_slice(part, self.part, self.dims.s)
        for dst, src in zip(new, self.tensors, strict=True):
            dst[sl].copy_(src)
        self.tensors, self.part, self.raw = new, part, False

    def add(self, part: Part, tensors: list[Tensor], from_compute: bool) -> None:
        if self.part is None:
            if from_compute:
                self.part, self.tensors, self.raw = part, list(tensors), True
            else:
                self.part, self.raw = part, False
                self.tensors = [t.to(torch.float32, copy=True) for t in tensors]
            return
        self._to_fp32(self.part.union(part))
        sl = sub_slice(self.part, part, self.dims.s)
        if self.kind == Kind.O:
            merge_partial(self.tensors[0][sl], self.tensors[1][sl], tensors[0], tensors[1])
        else:
            for acc, t in zip(self.tensors, tensors, strict=True):
                acc[sl].add_(t)

    def wire(self, raw: bool) -> list[Tensor]:
        """Tensors to send: in the input dtype when the plan says ``raw`` (the lse stays float32),
        else float32."""
        assert raw or not self.raw, "a single block result would travel in float32"
        tensors = self.tensors
        if raw and not self.raw:
            keep = 1 if self.kind == Kind.O else len(tensors)
            tensors = [t.to(self.dims.dtype) if i < keep else t for i, t in enumerate(tensors)]
        return [t.contiguous() for t in tensors]


def part_of(tensor: Tensor, held: Part, want: Part, length: int) -> Tensor:
    """Restrict a tensor that holds part ``held`` of a ``length``-token sequence to ``want``."""
    return tensor[sub_slice(held, want, length)]


__all__ = ["Accumulator", "Dims", "payload_specs", "part_of", "part_slice"]
