"""Smoke job for the Slurm launchers: every rank joins a gloo group and all-reduces its rank.

Started by ``scripts/launch/slurm_train.sbatch`` in place of the trainer (``TRAIN_SCRIPT``), and by
``scripts/launch/slurm_megatron.sbatch`` in place of Megatron-LM's ``pretrain_gpt.py``, so it sees
exactly the environment and arguments they would: torchrun's, or the one exported from ``SLURM_*``.
"""

from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    """Check the distributed environment, then all-reduce the ranks and verify the sum."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="the launcher's config (must exist when given)")
    args, rest = parser.parse_known_args()
    if args.config is not None and not os.path.isfile(args.config):
        raise SystemExit(f"config {args.config!r} does not exist")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise SystemExit(f"{name} is not set by the launcher")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    expected = world * (world - 1) / 2
    print(
        f"rank {rank}/{world} local {os.environ['LOCAL_RANK']} on {socket.gethostname()}: "
        f"sum {value.item():.0f}",
        flush=True,
    )
    if value.item() != expected:
        raise SystemExit(f"all_reduce gave {value.item()}, expected {expected}")
    dist.barrier()
    if rank == 0:
        print("arguments: " + " ".join(rest), flush=True)
        print(f"ALLREDUCE OK world_size={world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
