"""Run a :class:`LaunchSpec` to the end: fail fast, time out, and leave no rank behind on signals.

Failure behaviour:

* a rank exits non-zero or is killed by a signal: the others are stopped at once (SIGTERM to
  their process groups, SIGKILL after ``kill_grace_s``); :meth:`LaunchResult.check` raises
  :class:`LaunchError` naming the first such rank and its exit code or signal;
* ``timeout_s`` passes: every rank is stopped, and ``check`` says the run timed out;
* SIGINT, SIGTERM or SIGHUP reach the launcher (Ctrl-C, ``kill``, Slurm's ``scancel`` or time
  limit, a closed terminal): every rank is stopped, then the signal takes the effect it would have
  had without the launcher (``KeyboardInterrupt`` for SIGINT; the previous handler, or death by
  the signal); a second signal while stopping skips the grace period;
* the launcher is killed outright (SIGKILL): the kernel kills the ranks (Linux parent-death
  signal, see :mod:`megatron_charm.launch.group`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

from megatron_charm.launch.group import _POLL_S, RankExit, RankGroup
from megatron_charm.launch.spec import LaunchSpec

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class LaunchError(RuntimeError):
    """A launch failed: a rank died, the run timed out or a signal interrupted it."""


class _Interrupted(BaseException):
    """Raised by the launcher's signal handler in the launcher's main thread."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclass
class LaunchResult:
    """Outcome of one launch."""

    ranks: list[RankExit]
    elapsed_s: float
    timed_out: bool
    timeout_s: float | None
    first_failure: int | None = None
    """Rank whose failure made the launcher stop the others (lowest failing rank)."""

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    def error(self) -> str | None:
        """Why the run failed, or ``None`` when every rank exited 0."""
        if self.ok:
            return None
        if self.timed_out:
            return (
                f"timed out after {self.elapsed_s:.1f} s (timeout_s={self.timeout_s:g}); "
                "every rank was stopped"
            )
        assert self.first_failure is not None, "a failed run without a failing rank"
        return f"{self.ranks[self.first_failure].describe()}; the other ranks were stopped"

    def check(self) -> LaunchResult:
        """Raise :class:`LaunchError` unless every rank exited 0; returns ``self`` otherwise."""
        why = self.error()
        if why is not None:
            raise LaunchError(why)
        return self


def run(spec: LaunchSpec) -> LaunchResult:
    """Start ``spec.nproc`` ranks and wait for all of them (see the module doc for failures).

    Signal handlers are installed only when called from the main thread.
    """
    group = RankGroup(spec)
    start = time.monotonic()
    deadline = start + spec.timeout_s if spec.timeout_s is not None else float("inf")
    timed_out = False
    handlers = _SignalScope(group)
    try:
        group.start()
        while not group.all_exited():
            if group.first_failure() is not None:
                group.stop()
                break
            if time.monotonic() > deadline:
                timed_out = True
                group.stop()
                break
            time.sleep(_POLL_S)
        group.close_logs()
    except _Interrupted as exc:
        handlers.caught = exc.signum
        group.stop()
    except BaseException:
        group.stop()
        raise
    finally:
        handlers.restore()
    if handlers.caught is not None:
        handlers.redeliver()
        raise LaunchError(
            f"interrupted by {signal.Signals(handlers.caught).name}; every rank was stopped"
        )
    exits = group.exits()
    failed = next((r.global_rank for r in exits if r.returncode != 0), None)
    # A rank stopped because of another's failure also fails; blame the one that was not stopped.
    first = next((r.global_rank for r in exits if r.returncode != 0 and not r.killed), failed)
    return LaunchResult(
        exits, time.monotonic() - start, timed_out, spec.timeout_s, None if timed_out else first
    )


class _SignalScope:
    """The launcher's handlers for :data:`FORWARDED_SIGNALS` while its ranks run."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.caught: int | None = None
        self.previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # Python runs handlers in the main thread only
        for sig in FORWARDED_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue  # e.g. SIGHUP under nohup: the user asked for it to change nothing
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.group.stopping:
            # Already stopping (failure, timeout or an earlier signal): no more grace, and the
            # signal still takes effect once the ranks are gone.
            self.caught = self.caught or signum
            self.group.kill()
            return
        raise _Interrupted(signum)

    def restore(self) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)

    def redeliver(self) -> None:
        """Give the caught signal the effect it would have had without the launcher."""
        assert self.caught is not None, "redeliver without a caught signal"
        old = self.previous.get(self.caught, signal.SIG_DFL)
        if callable(old):
            old(self.caught, None)  # e.g. Python's SIGINT handler raises KeyboardInterrupt
        elif old in (signal.SIG_DFL, None):
            os.kill(os.getpid(), self.caught)
            time.sleep(1.0)  # the default action ends the process before this returns
