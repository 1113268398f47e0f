"""Who talks to whom: merge levels (paper 3.1) and the RM+ kv/q split (paper 3.2, Algorithm 1).

Note [Merge levels and the complementary split]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Inside a group of ``p`` ranks, level ``k`` (0-based) pairs local index ``x`` with ``x ^ j`` for
``j`` in ``[2^k, 2^(k+1))``; partners ``>= p`` are skipped, so any ``p`` works. For p = 8::

    level 0 (j=1)      0-1  2-3  4-5  6-7                      kv
    level 1 (j=2,3)    0-2 0-3  1-3 1-2  4-6 4-7  5-7 5-6      kv if bit 0 agrees, else q
    level 2 (j=4..7)   0-4 0-5 0-6 0-7  ...                    kv if bit 1 agrees, else q

Algorithm 1 splits the sorted partner list of a level in two halves and lets the lower half of the
already-merged group take (first -> kv, second -> q) and the upper half the reverse. For a power of
two that is exactly "kv when bit ``k-1`` of both local indices agrees": a symmetric relation, so
both sides of a pair always choose the same exchange. We use the bit form for every ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class PartnerTask:
    """One partner of a rank in the intra-node pipeline."""

    level: int
    j: int  # the XOR distance; symmetric, and the order key on both sides
    peer_local: int
    exchange_kv: bool  # True: swap kv; False: swap q and return the outputs


def num_levels(p: int) -> int:
    """``ceil(log2 p)`` merge levels for ``p`` ranks."""
    return max(0, (p - 1).bit_length())


@lru_cache(maxsize=4096)
def partner_tasks(local: int, p: int, split: bool) -> tuple[PartnerTask, ...]:
    """Partners of local index ``local`` in a group of ``p``, in (level, j) order.

    ``split=False`` gives the plain merge mechanism (every exchange moves kv); ``split=True``
    gives RM+.
    """
    tasks = []
    for level in range(num_levels(p)):
        for j in range(1 << level, 1 << (level + 1)):
            peer = local ^ j
            if peer >= p:
                continue
            kv = True
            if split and level > 0:
                bit = 1 << (level - 1)
                kv = (local & bit) == (peer & bit)
            tasks.append(PartnerTask(level, j, peer, kv))
    return tuple(tasks)
