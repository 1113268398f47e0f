"""The smallest trainer run of the fault tests: CP 2 on two self-started CPU ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--nproc", "2", "parallel.context_parallel_size=2", "parallel.ranks_per_node=1",
    "model.num_layers=1", "model.seq_length=32", "train.micro_batch_size=2",
    "train.global_batch_size=2", "logging.log_interval=1", "logging.progress_interval_s=0",
    "parallel.timeout_s=30",
]  # fmt: skip
"""Overrides of the default config: one layer, 32 tokens, CP 2 over two emulated nodes."""
SUBPROCESS_LIMIT_S = 900
"""Seconds a trainer command may take on a loaded machine before the test gives up."""


def environ(**extra: str) -> dict[str, str]:
    """This process's environment with the repository importable (and ``extra``)."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=str(REPO) + (os.pathsep + path if path else ""), **extra)


def run(module: str, args: list[str], **extra: str) -> subprocess.CompletedProcess:
    """``python -m module args`` in the repository, to the end."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=environ(**extra),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_LIMIT_S,
    )
