"""A persistent pool of gloo ranks for the integration tests.

Spawning ranks and importing megatron-core costs seconds per process, so each pool is started once
per test folder and runs many workloads. Every rank runs the same function; results come back
per rank. Each call has a timeout, so a deadlock fails the test instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import socket
import traceback
from typing import Any


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(global_rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.update(
        RANK=str(global_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(global_rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    while True:
        task = tasks.get()
        if task is None:
            break
        target, args, kwargs = task
        module_name, fn_name = target.split(":")
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            results.put((global_rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the test process
            results.put((global_rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned ranks sharing one gloo world."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, self.tasks[r], self.results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, target: str, *args: Any, timeout: float = 240.0, **kwargs: Any) -> list[Any]:
        """Run ``module:function(*args, **kwargs)`` on every rank; results ordered by rank."""
        for q in self.tasks:
            q.put((target, args, kwargs))
        out: dict[int, Any] = {}
        errors = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(
                    f"{target}: no result within {timeout}s (deadlock?); pool stopped"
                ) from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError(f"{target} failed:\n" + "\n".join(errors))
        return [out[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for proc in self.procs:
                proc.join(timeout=20)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
