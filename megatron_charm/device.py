"""Which CUDA device a rank uses, for every way of starting ranks.

* torchrun, or Slurm tasks that see all of the node's GPUs (``--gpus-per-node``): each process
  sees every GPU and takes device ``LOCAL_RANK``.
* Slurm with ``--gpus-per-task=1`` (or any binding that gives each task its own GPU): each process
  sees exactly one GPU, as device 0, whatever its ``LOCAL_RANK``; ``set_device(LOCAL_RANK)`` would
  fail there for every local rank but the first.
* Several processes sharing one GPU (tests, the one-GPU check) also see one device: device 0.
"""

from __future__ import annotations

import os


def select_cuda_device(local_rank: int, visible_device_count: int) -> int:
    """The CUDA device index for a rank with ``local_rank`` that sees ``visible_device_count``
    devices (``torch.cuda.device_count()``, which honours ``CUDA_VISIBLE_DEVICES``).

    Raises:
        ValueError: no device visible, or more than one visible but fewer than ``local_rank + 1``
            (an ambiguous binding: say which GPU each task gets).
    """
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK={local_rank}: must be >= 0 (check the launcher's env)")
    if visible_device_count < 1:
        raise ValueError(
            f"LOCAL_RANK={local_rank} wants a GPU but this process sees none (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); request GPUs for every task "
            "(sbatch --gpus-per-node=G or --gpus-per-task=1), or set MEGATRON_CHARM_DEVICE=cpu"
        )
    if visible_device_count == 1:
        return 0
    if local_rank < visible_device_count:
        return local_rank
    raise ValueError(
        f"LOCAL_RANK={local_rank} but this process sees {visible_device_count} GPUs (CUDA_VISIBLE_"
        f"DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): start at most one rank per visible "
        "GPU (torchrun --nproc-per-node / sbatch --ntasks-per-node = GPUs per node), or give each "
        "task its own GPU with --gpus-per-task=1"
    )


def set_cuda_device(index: int) -> None:
    """``torch.cuda.set_device(index)`` for a caller that chose the device itself (the one-GPU
    check puts every process on device 0); ranks of a job use :func:`set_cuda_device_from_env`."""
    import torch

    torch.cuda.set_device(index)


def set_cuda_device_from_env() -> int:
    """``torch.cuda.set_device`` to :func:`select_cuda_device` of ``LOCAL_RANK`` (default 0) and
    the visible device count; returns the index."""
    import torch

    index = select_cuda_device(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
    torch.cuda.set_device(index)
    return index
