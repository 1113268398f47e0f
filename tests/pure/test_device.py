"""CUDA device choice for torchrun-style and per-task (``srun --gpus-per-task=1``) bindings."""

from __future__ import annotations

import pytest

from megatron_charm import device


@pytest.mark.parametrize("local_rank", range(8))
def test_all_gpus_visible_takes_local_rank(local_rank):
    assert device.select_cuda_device(local_rank, 8) == local_rank


@pytest.mark.parametrize("local_rank", range(8))
def test_one_gpu_per_task_takes_device_zero(local_rank):
    # srun --gpus-per-task=1: set_device(LOCAL_RANK) would fail for local_rank >= 1
    assert device.select_cuda_device(local_rank, 1) == 0


def test_ambiguous_and_empty_bindings_are_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match="LOCAL_RANK=3 but this process sees 2 GPUs"):
        device.select_cuda_device(3, 2)
    with pytest.raises(ValueError, match="sees none"):
        device.select_cuda_device(0, 0)


def test_launchers_use_the_helper(monkeypatch):
    """Every set_device in the package goes through the helper (reads LOCAL_RANK and the count)."""
    import torch

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    assert device.set_cuda_device_from_env() == 0 and calls == [0]


def test_no_direct_set_device_calls():
    import pathlib

    import megatron_charm

    root = pathlib.Path(megatron_charm.__file__).parent
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "set_device(" in p.read_text() and p.name != "device.py"
    ]
    assert offenders == [], "call megatron_charm.device.set_cuda_device_from_env instead"
