"""Shape helpers shared by the block kernels: GQA head expansion/folding, head-dim padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

Tensor = torch.Tensor


def expand_kv_heads(t: Tensor, heads: int) -> Tensor:
    """``[x, y, h_kv, d]`` -> ``[x, y, heads, d]`` (query head ``i`` uses kv head ``i // g``)."""
    groups = heads // t.shape[2]
    return t if groups == 1 else t.repeat_interleave(groups, dim=2)


def fold_kv_heads(g: Tensor, kv_heads: int) -> Tensor:
    """Sum a gradient ``[x, y, h, d]`` over each kv head's query group -> ``[x, y, h_kv, d]``."""
    s, b, h, d = g.shape
    if h == kv_heads:
        return g
    return g.reshape(s, b, kv_heads, h // kv_heads, d).sum(dim=3)


def pad_head_dim(t: Tensor, multiple: int = 8) -> Tensor:
    """Zero-pad the last dimension of ``[..., d]`` up to a multiple of ``multiple``.

    The CUDA flash kernels need ``d % 8 == 0``. Zero columns change neither ``q k^T`` nor the
    kept columns of ``p v``, so padding q, k, v (and out, dout in the backward) and slicing the
    results back is exact.
    """
    extra = -t.shape[-1] % multiple
    return t if extra == 0 else F.pad(t, (0, extra))
