"""The attention fault cases as ranks: ``python -m tests.faults.attention_ranks OUT TIMEOUT_S``.

Every case is its own gloo world of ``cp_size`` ranks (a file store in ``OUT/<case>``), so the
cases run side by side without touching each other. Torch is imported once here and the ranks are
forked from this process (a fresh interpreter per rank would cost seconds of imports each).

Each rank builds a :class:`~megatron_charm.CPTopology` over its world with ``timeout=TIMEOUT_S``
and runs two steps of ``cp_attention`` (forward, then backward). The last CP rank is the faulty
one; the others record how their step ended. ``OUT/<case>/rank<R>.json`` holds what one rank
saw, ``rank<R>.log`` its stdout and stderr (native messages included), and ``OUT/exits.json`` the
exit status of every rank (negative: killed by that signal; ``null``: it hung and was killed).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_charm as mc
import megatron_charm.function as function
from megatron_charm.comm.executor import DistributedError

PHASES = ("before_forward", "during_forward", "after_forward", "during_backward", "after_backward")
STEPS = 2
STARTUP_S = 120.0
"""Timeout of the rendezvous and of the job's own groups: ranks start together on a loaded
machine; only the CP groups under test get the short timeout."""
STALL_TIMEOUTS = 2.5
"""A stalled rank sleeps this many CP timeouts."""


@dataclass(frozen=True)
class Case:
    """One fault: ``kind`` is ``kill``, ``stall``, ``options`` or ``shape``."""

    kind: str
    cp_size: int
    ranks_per_node: int
    phase: str = ""
    signal: str = ""


def _cases() -> dict[str, Case]:
    cases = {}
    for sig in ("SIGKILL", "SIGTERM"):
        for phase in PHASES:
            # 2 nodes x 2 ranks: every channel (cross and intra) meets the dead rank.
            cases[f"kill-{sig}-{phase}"] = Case("kill", 4, 2, phase, sig)
    cases["stall-before_forward"] = Case("stall", 2, 1, "before_forward")
    cases["stall-during_forward"] = Case("stall", 2, 1, "during_forward")
    cases["mismatch-options"] = Case("options", 2, 1)
    cases["mismatch-shape"] = Case("shape", 2, 1)
    return cases


CASES = _cases()


class _Faulty:
    """A block kernel that hands over to the fault at its first call of one pass."""

    def __init__(self, inner, backward: bool, fault) -> None:
        self.inner, self.at_backward, self.fault, self.fired = inner, backward, fault, False

    def _maybe(self, backward: bool) -> None:
        if backward == self.at_backward and not self.fired:
            self.fired = True
            self.fault()

    def forward(self, *args, **kwargs):
        self._maybe(False)
        return self.inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self._maybe(True)
        return self.inner.backward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _inject_into_kernel(backward: bool, fault) -> None:
    select = function.select_kernel
    function.select_kernel = lambda *a, **k: _Faulty(select(*a, **k), backward, fault)


def _wait_for(paths: list[Path], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.01)


def _inputs(cp_rank: int, s_local: int = 8):
    g = torch.Generator().manual_seed(cp_rank)
    q = torch.randn(1, s_local, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(1, s_local, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(1, s_local, 2, 8, generator=g, requires_grad=True)
    return q, k, v


def _rank(name: str, cp_rank: int, out: Path, timeout_s: float) -> None:
    case = CASES[name]
    log = os.open(out / f"rank{cp_rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out / 'store'}",
        rank=cp_rank,
        world_size=case.cp_size,
        timeout=timedelta(seconds=STARTUP_S),
    )
    short = timedelta(seconds=timeout_s)
    # Barriers on the start-up timeout line the ranks up, so that a rank the loaded machine
    # starts late does not time out the short-timeout groups while they are being set up.
    dist.barrier()
    group = dist.new_group(list(range(case.cp_size)), timeout=short)
    dist.barrier()
    topo = mc.CPTopology.build(group, ranks_per_node=case.ranks_per_node, timeout=short)
    dist.barrier()
    faulty = cp_rank == case.cp_size - 1
    others = [r for r in range(case.cp_size) if r != cp_rank]
    record: dict = {"cp_rank": cp_rank, "faulty": faulty, "passes": [], "error": None}

    def die() -> None:
        os.kill(os.getpid(), getattr(signal, case.signal))

    def stall() -> None:
        time.sleep(STALL_TIMEOUTS * timeout_s)

    def marker(step: int, what: str, rank: int = cp_rank) -> Path:
        return out / f"rank{rank}.{what}{step}"

    def fault_after(step: int, what: str) -> None:
        # Die once every other rank finished the pass too, so that it is the next pass that
        # meets the dead rank.
        if faulty and case.kind == "kill" and step == 0 and case.phase == f"after_{what}":
            _wait_for([marker(step, what, r) for r in others], STARTUP_S)
            die()

    if faulty and case.phase.startswith("during_"):
        _inject_into_kernel(case.phase.endswith("backward"), die if case.kind == "kill" else stall)
    options = mc.PlanOptions()
    if faulty and case.kind == "options":
        options = mc.PlanOptions(cross_return="fp32")  # the others run the default, input
    where, began = "", time.monotonic()
    try:
        for step in range(STEPS):
            s_local = 12 if (faulty and case.kind == "shape" and step == 1) else 8
            q, k, v = _inputs(cp_rank, s_local)
            if faulty and step == 0 and case.phase == "before_forward":
                die() if case.kind == "kill" else stall()
            where, began = f"forward{step}", time.monotonic()
            out_t = mc.cp_attention(q, k, v, topo, options=options, causal=True)
            record["passes"].append(where)
            marker(step, "forward").touch()
            fault_after(step, "forward")
            where, began = f"backward{step}", time.monotonic()
            out_t.sum().backward()
            record["passes"].append(where)
            marker(step, "backward").touch()
            fault_after(step, "backward")
    except (DistributedError, ValueError) as exc:
        record["error"] = [type(exc).__name__, where, time.monotonic() - began, str(exc)]
    except Exception as exc:  # noqa: BLE001 - any other type is a failure the test reports
        record["error"] = [type(exc).__name__, where, time.monotonic() - began, repr(exc)]
    (out / f"rank{cp_rank}.json").write_text(json.dumps(record))
    # What a script (or the trainer) does on its way out; a native abort here shows in the log.
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def main() -> None:
    out, timeout_s = Path(sys.argv[1]), float(sys.argv[2])
    names = sys.argv[3:] or list(CASES)
    fork = multiprocessing.get_context("fork")
    procs: dict[tuple[str, int], multiprocessing.Process] = {}
    for name in names:
        (out / name).mkdir(parents=True, exist_ok=True)
        for cp_rank in range(CASES[name].cp_size):
            proc = fork.Process(target=_rank, args=(name, cp_rank, out / name, timeout_s))
            proc.start()
            procs[(name, cp_rank)] = proc
    # Longest case: a rank stalls STALL_TIMEOUTS timeouts, then meets the error; plus start-up.
    deadline = time.monotonic() + STARTUP_S + (STALL_TIMEOUTS + 4) * timeout_s
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
    exits: dict[str, dict[int, int | None]] = {name: {} for name in names}
    for (name, cp_rank), proc in procs.items():
        hung = proc.is_alive()
        if hung:
            proc.kill()
            proc.join()
        exits[name][cp_rank] = None if hung else proc.exitcode
    (out / "exits.json").write_text(json.dumps(exits))


if __name__ == "__main__":
    main()
