"""Download a distribution from the package index with pip into a cache outside the repository."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


class SourceUnavailable(RuntimeError):
    """The download failed (no network, no index): contract tests skip with this reason."""


def cache_dir() -> Path:
    """``$MEGATRON_CHARM_CACHE`` or ``$XDG_CACHE_HOME/megatron-charm`` (``~/.cache/...``)."""
    root = os.environ.get("MEGATRON_CHARM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron-charm"
    )
    return Path(root)


def pip_download(requirement: str, dest: Path, *extra: str, env: dict | None = None) -> None:
    """``pip download --no-deps [extra] requirement -d dest``; raises :class:`SourceUnavailable`."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        *extra,
        requirement,
        "-d",
        str(dest),
    ]
    full_env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", **(env or {}))
    try:
        res = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourceUnavailable(f"pip download {requirement}: {exc}") from exc
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise SourceUnavailable(f"pip download {requirement} failed: {tail}")
