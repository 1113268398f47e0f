"""Load a script of ``scripts/bench`` as a module, for tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "bench"


def load_bench_script(name: str) -> ModuleType:
    """``scripts/bench/<name>.py``, imported (not run as ``__main__``)."""
    qualified = f"bench_scripts.{name}"
    spec = importlib.util.spec_from_file_location(qualified, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    # registered first: a dataclass looks its module up while it is being defined
    sys.modules[qualified] = mod
    spec.loader.exec_module(mod)
    return mod
