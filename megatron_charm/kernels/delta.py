"""The backward bundle's ``delta`` in place of ``out``.

Note [The backward bundle]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A block's backward needs the final ``out`` of its queries only through
``delta = rowsum(dout * out)`` (float32 ``[s, b, h]``, ``d`` times smaller than ``out``): every
kernel we call (flash-attn, PyTorch's fused ops, the math kernel) computes that and nothing else
from ``out``. So the bundle a query's owner ships for the backward is ``q, dout, lse, delta``,
not ``q, out, dout, lse``: one query-sized tensor less on every link it crosses::

    owner:     delta = sum_d(dout * out)             float32, once per query
    wire:      q, dout (input dtype), lse, delta     (float32 [s, b, h] each)
    receiver:  out' with sum_d(dout * out') = delta, zero but for the row's largest |dout|
               kernel.backward(dout, q, k, v, out', lse)
    owner:     kernel.backward(dout, q, k, v, out, lse)   its own blocks: the real out

``out'`` is not the output, only a tensor with the right row sums against ``dout``. A kernel
forms ``delta`` in float32 from products of two input-dtype numbers, which float32 holds exactly,
so ``out'`` is built as a short expansion on the row's ``TERMS`` largest ``|dout_j|``: each term
``c_j = r / dout_j`` rounded to the input dtype, ``r`` the remainder the earlier terms left.
Every term multiplies the remainder's relative error by the input dtype's unit roundoff (2^-9 for
bf16), so three terms reach float32's own rounding of ``delta``, as if the kernel had the real
``out``. A row with fewer non-zero ``dout_j`` has fewer terms, which are then exact (one term:
``delta = dout_j * out_j``); a term that would overflow the input dtype is left out.
"""

from __future__ import annotations

import torch
from torch import Tensor


def row_delta(out: Tensor, dout: Tensor) -> Tensor:
    """``out, dout [s, b, h, d]`` -> ``delta = sum_d(dout * out)``, float32 ``[s, b, h]``."""
    return (dout.float() * out.float()).sum(-1)


TERMS = 3


def out_for_delta(dout: Tensor, delta: Tensor) -> Tensor:
    """``dout [s, b, h, d]``, float32 ``delta [s, b, h]`` -> ``out' [s, b, h, d]`` in
    ``dout``'s dtype with ``sum_d(dout * out') = delta`` to float32 rounding (Note [The
    backward bundle])."""
    g = dout.float()
    # the row's largest |dout_j| one at a time: a max and a scatter per term cost about half
    # of one topk over the row on CPU, where this runs once per block
    mag = g.abs()
    rest = delta.float().clone()
    fake = torch.zeros_like(g)
    for _ in range(min(TERMS, g.shape[-1])):
        top, idx = mag.max(dim=-1, keepdim=True)
        gj = g.gather(-1, idx).squeeze(-1)
        nonzero = top.squeeze(-1) != 0
        c = torch.where(nonzero, rest / torch.where(nonzero, gj, 1.0), 0.0).to(dout.dtype)
        c = torch.where(torch.isfinite(c), c, torch.zeros_like(c)).float()
        fake.scatter_(-1, idx, c.unsqueeze(-1))
        rest = rest - gj * c
        mag.scatter_(-1, idx, -1.0)  # below every |dout_j|: the next max is another entry
    return fake.to(dout.dtype)
