"""A measurement script's ranks on a fresh testbed, and their results back as JSON.

The scripts of ``scripts/bench`` that measure on the testbed run themselves as every rank::

    script.py ARGS...                      # builds the testbed, runs the ranks, reads the result
      -> python script.py --rank-out OUT RANK_ARGS...   # one rank; rank 0 writes OUT (JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def add_rank_arguments(ap: argparse.ArgumentParser) -> None:
    """The internal arguments a rank of :func:`run_script_ranks` gets: ``--rank-out OUT`` (set
    only on a rank) and the positional ``rank_args``."""
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    ap.add_argument("rank_args", nargs="*", help=argparse.SUPPRESS)


def run_script_ranks(
    script: str,
    rank_args: list[str],
    nodes: int,
    ranks_per_node: int,
    cross_rate: str,
    topology: str | None = None,
    timeout_s: float = 900.0,
) -> object:
    """Run ``python script --rank-out OUT *rank_args`` as every rank of a fresh testbed of
    ``nodes x ranks_per_node`` (root, docs/testbed.md) and return the JSON that rank 0 wrote to
    ``OUT``. Raises ``RuntimeError`` with the end of the run's stderr when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        cmd = [sys.executable, "-m", "megatron_charm.testbed", "run", "--nodes", str(nodes)]
        cmd += ["--ranks-per-node", str(ranks_per_node), "--cross-rate", cross_rate]
        cmd += ["--topology", topology] if topology else []
        cmd += ["--", sys.executable, os.path.abspath(script), "--rank-out", out, *rank_args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode:
            raise RuntimeError(
                f"the testbed run of {os.path.basename(script)} on {nodes} x {ranks_per_node} "
                f"failed (exit {done.returncode}):\n{done.stderr[-2000:]}"
            )
        with open(out) as fh:
            return json.load(fh)


def gather_to_file(mine: object, out_path: str) -> None:
    """Collective over the default group: every rank's ``mine``, in global rank order, written
    by rank 0 to ``out_path`` as JSON; then the process group ends."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(everyone, fh)
    dist.destroy_process_group()
