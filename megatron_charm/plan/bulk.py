"""Building and replaying millions of small immutable objects without the cyclic collector.

Note [Pausing the cyclic collector]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A whole plan of 256 ranks holds millions of instructions, payloads and ops: frozen dataclasses
in tuples, which reference counting alone frees (they form no cycles). While they are being
created, CPython's cyclic collector runs again and again, and each of its full passes walks every
live object, so building and replaying large plans spent about a third of their time in it
(128 ranks, charm, causal, building the plan and replaying it in the simulator). The bulk work
runs with the collector paused; it resumes afterwards, and collects any cycle made
meanwhile then. A caller that had disabled it keeps it disabled.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause CPython's cyclic garbage collector for the block (Note [Pausing the cyclic
    collector])."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
