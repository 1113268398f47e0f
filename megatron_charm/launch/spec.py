"""What a launch is: the command, how many ranks, the rendezvous and each rank's environment."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from megatron_charm.constants import DEFAULT_TIMEOUT_S

KILL_GRACE_S = 3.0
"""Seconds between SIGTERM and SIGKILL when ranks are stopped."""

ENV_INIT_METHOD = "MEGATRON_CHARM_INIT_METHOD"
"""Variable that carries ``torch.distributed``'s ``init_method`` to each rank (``env://`` with a
TCP rendezvous, ``file://...`` with a file store)."""

RENDEZVOUS = ("tcp", "file")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LaunchSpec:
    """``nproc`` local rank processes running one command, and how they find each other."""

    cmd: Sequence[str]
    """Command every rank runs (argv, without any per-rank ``prefix``)."""
    nproc: int
    """Number of ranks (``WORLD_SIZE``); rank ``r`` gets ``RANK=r``."""
    rendezvous: str = "tcp"
    """``"tcp"``: ``MASTER_ADDR``/``MASTER_PORT`` (a free port unless ``master_port`` is given);
    ``"file"``: a file store in ``store_path``, needing no port. Either way
    ``MEGATRON_CHARM_INIT_METHOD`` tells the rank which ``init_method`` to use."""
    master_addr: str = "127.0.0.1"
    """Address of rank 0's store for the TCP rendezvous."""
    master_port: int | None = None
    """Port of the TCP rendezvous; ``None`` picks a free one."""
    store_path: str | None = None
    """File of the file-store rendezvous (must not exist yet); required with ``"file"``."""
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    """Seconds the whole run may take; then every rank is stopped and the run fails. ``None``:
    no limit (a training run; its collectives still time out on their own)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables for every rank, over this process's environment."""
    rank_env: Callable[[int], Mapping[str, str]] | None = None
    """Per-rank variables, applied last (they may replace the launcher's own)."""
    prefix: Callable[[int], Sequence[str]] | None = None
    """Per-rank words put before ``cmd``, e.g. ``ip netns exec <namespace>``."""
    log_dir: str | None = None
    """Write rank ``r``'s output to ``rank<r>.out``/``rank<r>.err`` here; ``None``: the ranks
    share this process's stdout and stderr."""
    kill_grace_s: float = KILL_GRACE_S
    """Seconds a stopped rank gets between SIGTERM and SIGKILL."""

    def __post_init__(self) -> None:
        if not self.cmd:
            raise ValueError("cmd is empty: give the command each rank runs")
        if self.nproc < 1:
            raise ValueError(f"nproc={self.nproc!r}: start at least one rank")
        if self.rendezvous not in RENDEZVOUS:
            raise ValueError(
                f"rendezvous={self.rendezvous!r}: choose one of {', '.join(RENDEZVOUS)}"
            )
        if self.rendezvous == "file" and not self.store_path:
            raise ValueError("rendezvous='file' needs store_path, the file of the store")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r}: must be positive")
        if self.kill_grace_s < 0:
            raise ValueError(f"kill_grace_s={self.kill_grace_s!r}: must not be negative")

    def argv(self, global_rank: int) -> list[str]:
        """Rank ``global_rank``'s full command line."""
        return [*(self.prefix(global_rank) if self.prefix else ()), *self.cmd]

    def rank_environ(self, global_rank: int, master_port: int) -> dict[str, str]:
        """Rank ``global_rank``'s whole environment."""
        env = dict(os.environ)
        env.update(self.env)
        # One compute thread per rank unless asked otherwise: the ranks share this machine's cores.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            RANK=str(global_rank),
            WORLD_SIZE=str(self.nproc),
            LOCAL_RANK=str(global_rank),
            LOCAL_WORLD_SIZE=str(self.nproc),
        )
        if self.rendezvous == "tcp":
            env.update(MASTER_ADDR=self.master_addr, MASTER_PORT=str(master_port))
            env[ENV_INIT_METHOD] = "env://"
        else:
            env[ENV_INIT_METHOD] = f"file://{self.store_path}"
        if self.rank_env is not None:
            env.update(self.rank_env(global_rank))
        return env
