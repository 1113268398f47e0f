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


# Module scope: an idle pool whose ranks hold Megatron's many gloo groups keeps two cores busy, so
# it must not outlive the tests that use it (the trainer tests start their own ranks).
@pytest.fixture(scope="module")
def pool4() -> Iterator[RankPool]:
    """Four CPU ranks (gloo), shared by the tests of one module."""
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool1() -> Iterator[RankPool]:
    """One CPU rank: the CP = 1 reference runs."""
    pool = RankPool(1)
    yield pool
    pool.close()
