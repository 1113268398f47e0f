"""Several processes of one check on one machine: spawned ranks, rendezvous, results, time limits.

A check that needs more than one rank runs its worker function in ``world`` *spawned* processes
(not threads: every rank has its own CUDA context, allocator and process groups, as on a real job).
A worker gets ``(global_rank, world, port, cfg)``, joins a fresh job on ``port`` with
:func:`init_group`, leaves it before returning, and returns a picklable result.

Starting processes that import torch costs seconds, so ranks with the same environment are kept in
a pool and serve the next check too (:func:`close_pools` ends them). A pool whose run fails is
killed, so no check inherits a rank left in a broken job.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from itertools import count
from typing import Any

from megatron_charm.launch import free_port


class RanksFailed(RuntimeError):
    """A rank raised, died or did not finish in time; the message says which and why."""


def _serve(global_rank: int, world: int, env: dict, plant: str | None, tasks, results) -> None:
    # A CUDA driver setting such as CUDA_DEVICE_MAX_CONNECTIONS must be in place before this
    # process creates its CUDA context, so it is set before anything touches CUDA.
    os.environ.update(env)
    import torch

    from megatron_charm.bench.gpu_check.plant import apply_plant

    torch.set_num_threads(1)
    apply_plant(plant)
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the check was killed (e.g. by the script's timeout)
                return
            continue
        if task is None:
            return
        task_id, fn, port, cfg = task
        try:
            results.put((task_id, global_rank, True, fn(global_rank, world, port, cfg)))
        except BaseException as exc:  # noqa: BLE001 - the parent reports it
            why = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            results.put((task_id, global_rank, False, why))


class _Pool:
    """``world`` spawned ranks with one environment, serving one task at a time."""

    _ids = count()

    def __init__(self, world: int, env: list[dict[str, str]], plant: str | None) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, env[r], plant, self.tasks[r], self.results))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, cfg: dict, timeout_s: float) -> list[Any]:
        task_id = next(self._ids)
        port = free_port()
        for q in self.tasks:
            q.put((task_id, fn, port, cfg))
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world)) - set(got))
                raise RanksFailed(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                tid, global_rank, ok, value = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
                if dead:
                    code = self.procs[dead[0]].exitcode
                    raise RanksFailed(f"global rank {dead[0]} died with exit code {code}") from None
                continue
            if tid != task_id:
                continue
            if not ok:
                raise RanksFailed(f"global rank {global_rank}: {value}")
            got[global_rank] = value
        return [got[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_pools: dict[tuple, _Pool] = {}


def run_ranks(
    fn: Callable[[int, int, int, dict], Any],
    world: int,
    cfg: dict,
    timeout_s: float,
    env: dict[str, str] | None = None,
    per_rank_env: Callable[[int], dict[str, str]] | None = None,
    plant: str | None = None,
) -> list[Any]:
    """Run ``fn(global_rank, world, port, cfg)`` on ``world`` spawned ranks; results in rank order.

    ``env`` (and ``per_rank_env(global_rank)``) are set in each rank before it imports torch;
    ``plant`` names a planted bug installed in every rank (test-only, :mod:`.plant`). Ranks with
    the same settings are reused from an earlier call.

    Raises:
        RanksFailed: a rank raised (its traceback is in the message), died, or the ranks did not
            all finish within ``timeout_s`` seconds; the ranks are then killed.
    """
    envs = [dict(env or {}) | (per_rank_env(r) if per_rank_env else {}) for r in range(world)]
    key = (world, repr(envs), plant)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = _Pool(world, envs, plant)
    try:
        return pool.run(fn, cfg, timeout_s)
    except BaseException:
        _pools.pop(key).close(kill=True)
        raise


def close_pools() -> None:
    """End every pooled rank."""
    while _pools:
        _pools.popitem()[1].close()


atexit.register(close_pools)


def init_group(global_rank: int, world: int, port: int, backend: str, timeout_s: float) -> None:
    """Join the check's job as ``global_rank`` of ``world`` (rendezvous on ``port``)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=global_rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
