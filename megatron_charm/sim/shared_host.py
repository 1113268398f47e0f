"""The shared host of a CPU profile as one processor-sharing queue (Note [Ranks sharing a host]
in :mod:`megatron_charm.sim.engine`).

Note [Virtual time on the host]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every flow on the host (a block, a merge, host work) is ``seconds alone`` of work, and all of
them run at one speed: ``min(1, capacity / flows)``. So they finish in the order of the work
they had left when they started, and only the first of them needs an event. The queue keeps a
virtual clock ``V``, the seconds of work each flow on the host has received since the replay
began; a flow that starts at ``V0`` with ``w`` seconds of work ends when ``V`` reaches
``V0 + w``:

    a (w=4)  [========][--------][===]    =: full speed, -: half speed (capacity 1)
    b (w=1)            [--------]
    time     0    1    2    3    4    5
    V        0    1    2   2.5   3    4     b: 2 + 1 = 3, so at 4; a: 0 + 4, so at 5

A start or an end changes the speed for every flow at once; the queue moves ``V`` and names
the next end, ``O(log flows)``, where rerating every flow on the host was ``O(flows)`` per
event (and ``O(flows)`` stale events in the replay's heap). With a profile of one CPU host on
4 x 8 a replay spent most of its time there.
"""

from __future__ import annotations

import heapq


class SharedHost:
    """Flows of seconds-alone work sharing ``capacity`` full-speed slots equally, each at most
    at full speed.

    Args:
        capacity: how many flows the host runs at full speed at once (> 0).
    """

    def __init__(self, capacity: float) -> None:
        assert capacity > 0, capacity
        self.capacity = capacity
        self._queue: list[tuple[float, int, object]] = []
        self._virtual = 0.0
        self._last = 0.0
        self._speed = 1.0
        self._seq = 0
        self.version = 0
        """Bumped whenever the next end moves: an event of an older version is stale."""

    def __len__(self) -> int:
        return len(self._queue)

    def _advance(self, now: float) -> None:
        self._virtual += self._speed * (now - self._last)
        self._last = now

    def _respeed(self) -> None:
        self._speed = min(1.0, self.capacity / len(self._queue)) if self._queue else 1.0
        self.version += 1

    def add(self, work: float, item: object, now: float) -> None:
        """Start ``item`` at ``now`` with ``work`` seconds of work alone."""
        self._advance(now)
        self._seq += 1
        heapq.heappush(self._queue, (self._virtual + work, self._seq, item))
        self._respeed()

    def pop(self, now: float) -> object:
        """End the first flow at ``now`` (its event of the current version) and return it."""
        self._advance(now)
        _, _, item = heapq.heappop(self._queue)
        self._respeed()
        return item

    def next_end(self, now: float) -> float | None:
        """When the first flow ends at the current speed (``None``: the host is idle)."""
        if not self._queue:
            return None
        left = self._queue[0][0] - self._virtual - self._speed * (now - self._last)
        return now + max(0.0, left) / self._speed
