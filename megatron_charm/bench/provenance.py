"""Which code a benchmark result came from: git queries on the repository that holds this
package (results record them next to their numbers)."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: The repository (or unpacked tree) that holds the package.
REPO = Path(__file__).resolve().parents[2]


def git(*args: str) -> str | None:
    """``git -C REPO <args>``'s stripped output, or ``None`` outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


#: CPU instruction sets that decide how fast torch's CPU kernels run in bf16 and fp32 (oneDNN
#: picks its kernels by them): the testbed's blocks took 5-9 times longer on an AVX2-only host
#: than on the one of the calibrations earlier that day (docs/results/calibrated-2x2.md, "The
#: host a profile describes", 2026-12-04).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def host() -> dict:
    """The machine a measurement ran on: ``cpu`` (model name), ``cores`` (logical CPUs),
    ``isa`` (the :data:`ISA_FLAGS` it has), ``torch`` (its version) and ``gpu`` (the first CUDA
    device's name, where torch is loaded and sees one); ``None`` where unknown."""
    import importlib.metadata
    import os
    import platform
    import sys

    cpu, flags = None, None
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and cpu is None:
                    cpu = value.strip()
                elif key == "flags" and flags is None:
                    flags = set(value.split())
    except OSError:
        pass
    try:
        torch_version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    gpu = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {
        "cpu": cpu or platform.processor() or None,
        "cores": os.cpu_count(),
        "isa": None if flags is None else [f for f in ISA_FLAGS if f in flags],
        "torch": torch_version,
        "gpu": gpu,
    }


#: The keys of a :func:`host` record, in the order :func:`host_differences` reports them.
HOST_KEYS = ("cpu", "cores", "isa", "gpu", "torch")


def host_differences(
    a: dict | None, b: dict | None, keys: tuple[str, ...] = HOST_KEYS
) -> list[str]:
    """What differs between two :func:`host` records in ``keys``, as ``"key: A vs B"``; a key
    either record lacks (or holds as ``None``) is not compared. ``["not recorded"]`` when either
    record is missing (results and profiles from before 2026-12-04 23:00 UTC)."""
    if not a or not b:
        return ["not recorded"]
    out = []
    for key in keys:
        x, y = a.get(key), b.get(key)
        if x is not None and y is not None and x != y:
            out.append(f"{key}: {x} vs {y}")
    return out
