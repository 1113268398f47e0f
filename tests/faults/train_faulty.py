"""``megatron-charm-train`` whose ranks can be made to die in the middle of a checkpoint save.

``python -m tests.faults.train_faulty ARGS`` is the trainer's command line; the self-started
ranks run this module too. With ``MC_TEST_CRASH_SAVE=<global rank>:<iteration>`` in the
environment (a test-only switch, read here and never by the library), that rank writes half of
its first file of that checkpoint under the file's temporary name and then kills itself with
SIGKILL, as a node failure or the OOM killer would end it.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path

from megatron_charm.train import checkpoint, cli

CRASH_ENV = "MC_TEST_CRASH_SAVE"
MODULE = "tests.faults.train_faulty"


def plant_crash(spec: str, global_rank: int) -> None:
    """Make ``global_rank`` die while writing checkpoint ``<iteration>`` of ``spec``."""
    rank, iteration = (int(x) for x in spec.split(":"))
    if rank != global_rank:
        return
    target = checkpoint.iteration_dir(Path("."), iteration).name
    atomic_write = checkpoint._atomic_write

    def write_half_then_die(path, write):
        if path.parent.name != target:
            return atomic_write(path, write)
        data = io.BytesIO()
        write(data)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data.getvalue()[: len(data.getvalue()) // 2])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint._atomic_write = write_half_then_die


if __name__ == "__main__":
    if os.environ.get(CRASH_ENV):
        plant_crash(os.environ[CRASH_ENV], int(os.environ.get("RANK", "0")))
    cli.MODULE = MODULE  # the self-started ranks run this module, crash and all
    sys.exit(cli.main())
