"""A started set of rank processes: each in its own session, tied to this process's life.

Linux only for the parent-death signal: elsewhere the ranks still get their own sessions and are
stopped by :meth:`RankGroup.stop`, but a launcher killed with SIGKILL leaves them running.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_charm.launch.spec import LaunchSpec, free_port

_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def describe_exit(returncode: int | None) -> str:
    """How a process ended, in words: ``exited with 3``, ``was killed by SIGKILL``."""
    if returncode is None:
        return "is still running"
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks the kernel to SIGKILL the child when this process dies."""
    if not sys.platform.startswith("linux"):
        return None
    # Resolved before fork: the child runs as little Python as possible before exec.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: the signal will never come
            os._exit(1)

    return preexec


@dataclass
class RankExit:
    """How one rank ended."""

    global_rank: int
    returncode: int | None
    """Exit status, negative when a signal killed it; ``None`` if it could not be reaped."""
    killed: bool = False
    """The launcher stopped it (another rank failed, timeout or interrupt)."""

    def describe(self) -> str:
        return f"rank {self.global_rank} {describe_exit(self.returncode)}"


class RankGroup:
    """The processes of one :class:`LaunchSpec`; :meth:`stop` ends all of them.

    Every rank is the leader of a new session, so ``stop`` reaches whatever the rank started too
    (its process group), and a Ctrl-C on the terminal reaches only the launcher, which then stops
    the ranks. On Linux each rank also gets SIGKILL when the thread that started it dies (the
    parent-death signal), so ranks do not outlive a launcher killed with SIGKILL. Start groups
    from a thread that lives as long as the ranks should (normally the main thread).
    """

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.procs: list[subprocess.Popen] = []
        self.killed: set[int] = set()
        self.stopping = False
        self._files: list = []

    def start(self) -> None:
        """Start every rank; if one cannot start, the started ones are stopped."""
        spec = self.spec
        port = spec.master_port or (free_port() if spec.rendezvous == "tcp" else 0)
        if spec.log_dir is not None:
            os.makedirs(spec.log_dir, exist_ok=True)
        preexec = _die_with_parent()
        try:
            for global_rank in range(spec.nproc):
                out = err = None
                if spec.log_dir is not None:
                    out = open(os.path.join(spec.log_dir, f"rank{global_rank}.out"), "w")
                    err = open(os.path.join(spec.log_dir, f"rank{global_rank}.err"), "w")
                    self._files += [out, err]
                self.procs.append(
                    subprocess.Popen(
                        spec.argv(global_rank),
                        env=spec.rank_environ(global_rank, port),
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                        preexec_fn=preexec,
                    )
                )
        except BaseException:
            self.stop()
            raise

    def first_failure(self) -> RankExit | None:
        """The lowest rank that ended with a non-zero status, if any."""
        for global_rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code not in (None, 0):
                return RankExit(global_rank, code, killed=global_rank in self.killed)
        return None

    def all_exited(self) -> bool:
        return all(proc.poll() is not None for proc in self.procs)

    def stop(self) -> None:
        """SIGTERM to every rank's process group, SIGKILL to those left after the grace period.

        Also signals groups whose leader already exited, for what the rank started.
        """
        self.stopping = True
        running = {r for r, p in enumerate(self.procs) if p.poll() is None}
        self.killed |= running
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.spec.kill_grace_s
        while time.monotonic() < deadline and any(self.procs[r].poll() is None for r in running):
            time.sleep(_POLL_S)
        self.kill()

    def kill(self) -> None:
        """SIGKILL to every rank's process group, then reap the ranks."""
        self.stopping = True
        self.killed |= {r for r, p in enumerate(self.procs) if p.poll() is None}
        self._signal_all(signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(timeout=max(self.spec.kill_grace_s, 1.0))
            except subprocess.TimeoutExpired:
                pass  # unkillable (uninterruptible sleep); reported as returncode None
        self.close_logs()

    def close_logs(self) -> None:
        for f in self._files:
            f.close()
        self._files.clear()

    def exits(self) -> list[RankExit]:
        return [RankExit(r, p.poll(), r in self.killed) for r, p in enumerate(self.procs)]

    def _signal_all(self, sig: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
