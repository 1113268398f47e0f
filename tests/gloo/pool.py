"""A persistent pool of gloo ranks for tests: spawned once, reused by many tests.

``pool.run(fn, **kwargs)`` calls ``fn(ctx, **kwargs)`` on every rank (``fn`` must be importable by
module and name) and returns the per-rank results, re-raising the first rank's failure. Every call
has a deadline, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any


@dataclass
class RankContext:
    """What a task sees on its rank."""

    rank: int
    world_size: int
    cache: dict = field(default_factory=dict)

    def topology(self, ranks_per_node: int | None = None, timeout_s: float = 60.0):
        """A CPTopology over the whole pool, built once per setting (collective)."""
        key = ("topo", ranks_per_node, timeout_s)
        if key not in self.cache:
            import megatron_charm as mc

            self.cache[key] = mc.CPTopology.build(
                None, ranks_per_node=ranks_per_node, timeout=timedelta(seconds=timeout_s)
            )
        return self.cache[key]


class RemoteError(RuntimeError):
    pass


def _worker(
    rank: int, world: int, store: str, tasks: mp.Queue, results: mp.Queue, pg_timeout: float
):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A file store needs no port, so pools never race other processes for one.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=pg_timeout),
    )
    ctx = RankContext(rank, world)
    while True:
        item = tasks.get()
        if item is None:
            break
        module, name, kwargs = item
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(ctx, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int, pg_timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        fd, self.store = tempfile.mkstemp(prefix="mc-pool-")
        os.close(fd)
        os.unlink(self.store)
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, self.store, self.tasks[r], self.results, pg_timeout),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run_raw(self, fn: Callable, timeout: float = 300.0, **kwargs: Any) -> dict[int, tuple]:
        """Run on all ranks; return ``{rank: (ok, value)}`` for ranks that answered in time."""
        if self.broken:
            raise RuntimeError("worker pool is broken by an earlier failure")
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, kwargs))
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        grace_set = False
        while len(got) < self.world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = self.results.get(timeout=0.5)
                got[rank] = (ok, value)
            except queue.Empty:
                dead = any(not p.is_alive() for r, p in enumerate(self.procs) if r not in got)
                if dead and not grace_set:
                    # a dead rank never answers; give the others a bounded moment to fail too
                    deadline, grace_set = min(deadline, time.monotonic() + 30), True
        if len(got) < self.world_size:
            self.broken = True
        return got

    def run(self, fn: Callable, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        got = self.run_raw(fn, timeout=timeout, **kwargs)
        if len(got) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(got))
            self.close()
            raise TimeoutError(f"ranks {missing} did not finish {fn.__name__} within {timeout}s")
        for rank in range(self.world_size):
            ok, value = got[rank]
            if not ok:
                raise RemoteError(f"rank {rank} failed:\n{value}")
        return [got[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if os.path.exists(self.store):
            os.unlink(self.store)
        self.broken = True
