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
