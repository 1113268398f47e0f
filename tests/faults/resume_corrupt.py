"""Resume damaged runs through the trainer's command: ``python -m tests.faults.resume_corrupt
OUT RUN_DIR... -- ARGS``.

For each run directory this calls ``megatron_charm.train.cli.main`` (what ``megatron-charm-train``
runs) with ``--run-dir RUN_DIR --resume ARGS`` as one local rank, one after the other in this
process, so that megatron-core is imported once for all of them. ``OUT`` receives, per run
directory, the exit status and everything the command wrote to stderr.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

from megatron_charm.train import cli


def main() -> None:
    split = sys.argv.index("--")
    out, run_dirs, args = sys.argv[1], sys.argv[2:split], sys.argv[split + 1 :]
    results = {}
    for run_dir in run_dirs:
        # Each resume is a job of its own: a fresh rendezvous, as a new command would have.
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = cli.main(["--run-dir", run_dir, "--resume", *args])
        results[run_dir] = [status, err.getvalue()]
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
