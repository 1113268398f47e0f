"""What the fault tests look for in processes: native crashes in logs, survivors in /proc."""

from __future__ import annotations

import os
import signal
import time

NATIVE_CRASH = (
    "Segmentation fault",
    "SIGSEGV",
    "SIGABRT",
    "Aborted",
    "terminate called",
    "Fatal Python error",
    "core dumped",
)
"""Words a native crash leaves on stderr (C++ terminate, glibc abort, Python's faulthandler)."""


def native_crashes(text: str) -> list[str]:
    """The :data:`NATIVE_CRASH` words found in ``text``."""
    return [word for word in NATIVE_CRASH if word in text]


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (e.g. a run directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and alive(int(entry)):
            found.append(int(entry))
    return found


def children(parent: int) -> list[int]:
    """Live processes whose parent is ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[1]) == parent and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def survivors_after(marker: str, bound_s: float) -> list[int]:
    """Processes with ``marker`` still alive ``bound_s`` from now (they are then SIGKILLed, so
    that a failing test leaves nothing behind)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and processes_with(marker):
        time.sleep(0.05)
    left = processes_with(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def default_signals() -> None:
    """``preexec_fn`` for a launcher under test: SIGINT and SIGHUP back to their default action.

    A shell's background jobs start with SIGINT ignored and ``nohup`` ignores SIGHUP, and the
    launcher keeps an ignored signal ignored (its user asked for that), so without this the
    signal tests would pass or fail with the way the test run itself was started."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
