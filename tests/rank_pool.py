"""A persistent pool of gloo ranks for tests: started once, reused by many tests.

Starting ranks and importing torch (and megatron-core) costs seconds per process, so a pool
starts ``world_size`` ranks once, through :mod:`megatron_charm.launch` like every launcher of the
project, and runs many tasks on them. ``pool.run(target, *args, **kwargs)`` calls the task on
every rank and returns the per-rank results, raising if any rank failed. ``target`` is a function
importable by module and name, or a ``"module:function"`` string. With ``context=True`` every task
gets a :class:`RankContext` first. Every call has a deadline, so a hang fails the test instead of
the suite. A pool whose rank died or hung is broken: it refuses further tasks.

Ranks talk to the pool over one authenticated Unix socket each, in plain pickles (tensors are
copied, not shared through ``torch.multiprocessing``'s file descriptors). They share one gloo
world (a file store, so pools never race other processes for a port) and run one compute thread
each.
"""

from __future__ import annotations

import importlib
import os
import pickle
import secrets
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

from megatron_charm.constants import DEFAULT_TIMEOUT_S
from megatron_charm.launch import RankGroup, RankInfo
from megatron_charm.launch.call import function_spec

DEAD_RANK_GRACE_S = 30.0
"""Seconds the other ranks get to fail too once one rank died (a dead rank never answers)."""
CLOSE_GRACE_S = 20.0
"""Seconds the ranks get to leave gloo and exit after the pool asks them to stop."""


@dataclass
class RankContext:
    """What a task sees on its rank (``context=True`` pools)."""

    global_rank: int
    """The rank's place in the pool's world (every pool rank is one CP rank)."""
    world_size: int
    cache: dict = field(default_factory=dict)

    def topology(self, ranks_per_node: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        """A CPTopology over the whole pool, built once per setting (collective)."""
        key = ("topo", ranks_per_node, timeout_s)
        if key not in self.cache:
            import megatron_charm as mc

            self.cache[key] = mc.CPTopology.build(
                None, ranks_per_node=ranks_per_node, timeout=timedelta(seconds=timeout_s)
            )
        return self.cache[key]


class RemoteError(RuntimeError):
    """A task raised on one or more ranks."""


def _resolve(target: str | Callable) -> tuple[str, str]:
    if callable(target):
        return target.__module__, target.__qualname__
    module, _, name = target.partition(":")
    return module, name


def _serve(info: RankInfo, address: str, authkey: bytes, context: bool, pg_timeout_s: float):
    """One rank of a pool: join gloo, then run tasks until the pool says stop."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    conn.send(info.global_rank)
    info.init_process_group("gloo", timeout_s=pg_timeout_s)
    ctx = RankContext(info.global_rank, info.world_size)
    while True:
        try:
            task = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if task is None:
            break
        module, name, args, kwargs = task
        try:
            fn: Any = importlib.import_module(module)
            for part in name.split("."):
                fn = getattr(fn, part)
            answer = (True, fn(ctx, *args, **kwargs) if context else fn(*args, **kwargs))
            data = pickle.dumps(answer)
        except BaseException as exc:  # noqa: BLE001 - report everything to the test process
            data = pickle.dumps((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        conn.send_bytes(data)
    # No destroy_process_group: with channel groups of several CP topologies it can wait on
    # peers that have already left (seen: 20 s of pool teardown). The process ends here anyway.
    conn.close()
    os._exit(0)


class RankPool:
    """``world_size`` ranks sharing one gloo world, each running the pool's tasks."""

    def __init__(
        self,
        world_size: int,
        pg_timeout_s: float = DEFAULT_TIMEOUT_S,
        context: bool = False,
    ) -> None:
        self.world_size = world_size
        self.broken = False
        self._dir = tempfile.mkdtemp(prefix="mc-pool-")
        address = os.path.join(self._dir, "pool.sock")
        authkey = secrets.token_bytes(16)
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        spec = function_spec(
            _serve,
            (address, authkey, context, pg_timeout_s),
            self._dir,
            nproc=world_size,
            env={"OMP_NUM_THREADS": "1"},
        )
        self._conns: dict[int, Connection] = {}
        self._group = RankGroup(spec)
        self._group.start()
        # accept() cannot time out; a thread waits for the ranks so that a rank that dies while
        # starting shows up as a dead rank in run() instead of a hang here.
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        try:
            for _ in range(self.world_size):
                conn = self._listener.accept()
                self._conns[conn.recv()] = conn
        except (OSError, EOFError):
            pass  # closed while waiting

    def _dead(self, rank: int) -> bool:
        return self._group.procs[rank].poll() is not None

    def _connect(self, deadline: float) -> None:
        while len(self._conns) < self.world_size and time.monotonic() < deadline:
            if any(self._dead(r) for r in range(self.world_size) if r not in self._conns):
                break
            time.sleep(0.05)

    def run_raw(
        self, target: str | Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
    ) -> dict[int, tuple[bool, Any]]:
        """Run on all ranks; return ``{rank: (ok, value)}`` for the ranks that answered in time
        (``value`` is the result, or the formatted exception)."""
        if self.broken:
            raise RuntimeError("worker pool is broken by an earlier failure")
        deadline = time.monotonic() + timeout
        self._connect(deadline)
        if len(self._conns) < self.world_size:
            self.broken = True
            return {}
        task = (*_resolve(target), args, kwargs)
        for global_rank in range(self.world_size):
            self._conns[global_rank].send_bytes(pickle.dumps(task))
        waiting = {conn: global_rank for global_rank, conn in self._conns.items()}
        got: dict[int, tuple[bool, Any]] = {}
        grace_set = False
        while waiting and time.monotonic() < deadline:
            for conn in wait(list(waiting), timeout=0.5):
                global_rank = waiting.pop(conn)
                try:
                    got[global_rank] = pickle.loads(conn.recv_bytes())
                except EOFError:
                    pass  # the rank died; it is missing from the answer
            if not grace_set and any(self._dead(r) for r in waiting.values()):
                deadline, grace_set = min(deadline, time.monotonic() + DEAD_RANK_GRACE_S), True
        if len(got) < self.world_size:
            self.broken = True
        return got

    def run(
        self, target: str | Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
    ) -> list[Any]:
        """Run on every rank; results ordered by rank. Raises :class:`RemoteError` naming every
        failing rank, or ``TimeoutError`` (and stops the pool) when a rank does not answer."""
        name = ":".join(_resolve(target))
        got = self.run_raw(target, *args, timeout=timeout, **kwargs)
        if len(got) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(got))
            dead = [e.describe() for e in self._exits(missing)]
            self.close()
            raise TimeoutError(
                f"{name}: ranks {missing} did not finish within {timeout}s (deadlock?)"
                + (f"; {', '.join(dead)}" if dead else "")
                + "; pool stopped"
            )
        errors = [f"rank {r}:\n{value}" for r, (ok, value) in sorted(got.items()) if not ok]
        if errors:
            raise RemoteError(f"{name} failed:\n" + "\n".join(errors))
        return [got[r][1] for r in range(self.world_size)]

    def _exits(self, ranks: list[int]):
        exits = self._group.exits()
        return [e for e in exits if e.global_rank in ranks and e.returncode is not None]

    def close(self) -> None:
        """Ask every rank to stop; stop those that do not within ``CLOSE_GRACE_S``."""
        self.broken = True
        for conn in self._conns.values():
            try:
                conn.send_bytes(pickle.dumps(None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + CLOSE_GRACE_S
        while time.monotonic() < deadline and not self._group.all_exited():
            time.sleep(0.05)
        self._group.stop()
        self._listener.close()
        for conn in self._conns.values():
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)
