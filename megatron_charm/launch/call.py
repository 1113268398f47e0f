"""Python functions as ranks: ``fn(info, *args)`` in ``nproc`` fresh interpreters.

``python -m megatron_charm.launch PAYLOAD`` is the rank side (:func:`rank_main`): it restores
the launcher's ``sys.path``, imports the function by module and name and calls it with a
:class:`RankInfo` built from the launcher's environment. Arguments travel pickled in a private
folder, as with ``multiprocessing``'s spawn.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from megatron_charm.constants import DEFAULT_TIMEOUT_S
from megatron_charm.launch.run import LaunchResult, run
from megatron_charm.launch.spec import ENV_INIT_METHOD, LaunchSpec

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def package_pythonpath(path: str | None = None) -> str:
    """``PYTHONPATH`` for a child process that must import this checkout of megatron_charm:
    its root first, then ``path`` (default: this process's ``PYTHONPATH``)."""
    path = os.environ.get("PYTHONPATH", "") if path is None else path
    return _PACKAGE_ROOT + (os.pathsep + path if path else "")


@dataclass(frozen=True)
class RankInfo:
    """Where a function rank sits in its launch."""

    global_rank: int
    """This process's global rank."""
    world_size: int
    """Number of ranks of the launch."""
    local_rank: int
    """Rank among the ranks of this machine."""
    init_method: str
    """``torch.distributed``'s ``init_method`` for the launch's rendezvous."""

    @property
    def rank(self) -> int:
        """:attr:`global_rank` under its name before 2026-12-05 (deprecated)."""
        warnings.warn(
            "RankInfo.rank is deprecated: use RankInfo.global_rank", DeprecationWarning, 2
        )
        return self.global_rank

    def init_process_group(
        self, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        """Join the launch's ``torch.distributed`` world."""
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=self.init_method,
            rank=self.global_rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )


def function_spec(fn: Callable[..., Any], args: tuple, workdir: str, **kw: Any) -> LaunchSpec:
    """A spec whose ranks call ``fn(info, *args)``; the payload is written into ``workdir``.

    ``fn`` must be importable by its module and name. ``kw`` are :class:`LaunchSpec` fields
    (``nproc`` at least); the rendezvous defaults to a file store in ``workdir``.
    """
    payload = os.path.join(workdir, "payload.pkl")
    with open(payload, "wb") as f:
        pickle.dump((list(sys.path), _module_of(fn), fn.__qualname__, pickle.dumps(args)), f)
    kw.setdefault("rendezvous", "file")
    if kw["rendezvous"] == "file":
        kw.setdefault("store_path", os.path.join(workdir, "store"))
    extra = dict(kw.pop("env", {}))
    extra["PYTHONPATH"] = package_pythonpath(extra.get("PYTHONPATH"))
    cmd = [sys.executable, "-m", "megatron_charm.launch", payload]
    return LaunchSpec(cmd=cmd, env=extra, **kw)


def _module_of(fn: Callable[..., Any]) -> str:
    """The name under which a rank can import ``fn``."""
    module = fn.__module__
    if module == "__main__":
        # Started with ``python -m pkg.mod``: the ranks import it as ``pkg.mod``.
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise ValueError(
                f"{fn.__qualname__} is defined in a script run by path; ranks import their "
                "function by module name: run the script with python -m, or move the function "
                "into a module"
            )
        module = spec.name
    return module


def run_function(fn: Callable[..., Any], *args: Any, nproc: int, **kw: Any) -> LaunchResult:
    """Run ``fn(info, *args)`` as ``nproc`` ranks; raises :class:`LaunchError` if any fails.

    ``kw`` are further :class:`LaunchSpec` fields (``timeout_s``, ``env``, ...).
    """
    workdir = tempfile.mkdtemp(prefix="mc-ranks-")
    try:
        return run(function_spec(fn, args, workdir, nproc=nproc, **kw)).check()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def rank_main(payload: str) -> None:
    """The rank side of :func:`function_spec`: call the function of ``payload``."""
    with open(payload, "rb") as f:
        path, module, qualname, args = pickle.load(f)
    sys.path[:] = path
    import importlib

    fn: Any = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    env = os.environ
    info = RankInfo(
        int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), env[ENV_INIT_METHOD]
    )
    fn(info, *pickle.loads(args))
    leave_rank(0)


def leave_rank(code: int = 0) -> NoReturn:
    """End a rank process that has finished its work, without the interpreter's teardown.

    Note [Leaving a rank process]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A gloo rank that returned normally was sometimes killed on its way out by "terminate
    called without an active exception" (SIGABRT): a native thread was still joinable when
    C++ static destructors ran, after the process group had been destroyed and every rank had
    passed a barrier (the memory benchmark's worker, the calibrate worker; about one run in
    three on one machine). Nothing a finished rank still needs happens in that teardown, so it
    flushes what Python buffers (logging handlers, stdout, stderr) and leaves with
    ``os._exit``. Work that fails raises before this and exits the usual way.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
