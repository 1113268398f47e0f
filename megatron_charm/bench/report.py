"""How a benchmark script hands over its table: printed, and kept in a file when asked."""

from __future__ import annotations

import os
from pathlib import Path


def emit(text: str, md: str | os.PathLike[str] | None) -> None:
    """Print ``text`` (a script's markdown table and its notes) and, when ``md`` names a file,
    write it there too, ending in one newline (``--md FILE`` of the scripts in scripts/bench)."""
    print(text)
    if md:
        Path(md).write_text(text.rstrip("\n") + "\n")
