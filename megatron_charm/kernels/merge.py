"""Merging partial attention results in float32.

Two partial results ``(o_a, lse_a)`` and ``(o_b, lse_b)`` of the same queries over disjoint keys
combine as::

    o   = o_a - sigmoid(lse_b - lse_a) * (o_a - o_b)
    lse = logaddexp(lse_a, lse_b)

The sigmoid form needs no exp of large numbers and is exact when one side is empty
(``lse = -inf``): sigmoid gives 0 or 1 and logaddexp returns the other side.
"""

from __future__ import annotations

import torch

_ACCUMULATOR_DTYPES = (torch.float32, torch.float64)


def merge_partial(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> None:
    """Merge ``(out_b, lse_b)`` into ``(out, lse)`` in place.

    Args:
        out: float32 (or float64) ``[s, b, h, d]`` accumulator.
        lse: ``[s, b, h]`` accumulator in out's dtype.
        out_b: ``[s, b, h, d]``, any float dtype.
        lse_b: ``[s, b, h]``, any float dtype.

    Rows empty on both sides (``-inf`` twice, which masks produce) stay empty: the sigmoid of
    ``-inf - -inf`` is NaN and is taken as 0.
    """
    # Merging in a low-precision accumulator loses the small corrections of later blocks.
    if out.dtype != lse.dtype or out.dtype not in _ACCUMULATOR_DTYPES:
        raise ValueError(
            f"merge_partial(out.dtype={out.dtype}, lse.dtype={lse.dtype}): the accumulators "
            "must share one dtype, float32 or float64; pass float32/float64 out and lse "
            "(e.g. out.float(), lse.float())"
        )
    weight = torch.sigmoid(lse_b - lse).nan_to_num_(0.0).unsqueeze(-1)
    out.sub_(weight * (out - out_b.to(out.dtype)))
    torch.logaddexp(lse, lse_b.to(lse.dtype), out=lse)
