"""Fixtures for the Megatron integration tests: persistent gloo rank pools."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from tests.rank_pool import RankPool  # noqa: E402

# Run directories of the training workloads (the workers inherit the environment).
if "MC_TEST_RUN_ROOT" not in os.environ:
    os.environ["MC_TEST_RUN_ROOT"] = tempfile.mkdtemp(prefix="megatron-charm-runs-")
    atexit.register(shutil.rmtree, os.environ["MC_TEST_RUN_ROOT"], ignore_errors=True)

# Worker processes import the workloads module by name.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p
)


@pytest.fixture(scope="package")
def pool4() -> Iterator[RankPool]:
    """Four CPU ranks (gloo), shared by the tests in this folder."""
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="package")
def pool1() -> Iterator[RankPool]:
    """One CPU rank: the CP = 1 reference runs."""
    pool = RankPool(1)
    yield pool
    pool.close()
