"""Fixtures for the Megatron integration tests: persistent gloo rank pools."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.rank_pool import RankPool

# Run directories of the training workloads (the workers inherit the environment).
if "MC_TEST_RUN_ROOT" not in os.environ:
    os.environ["MC_TEST_RUN_ROOT"] = tempfile.mkdtemp(prefix="megatron-charm-runs-")
    atexit.register(shutil.rmtree, os.environ["MC_TEST_RUN_ROOT"], ignore_errors=True)


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
