import pytest

from tests.gloo.pool import WorkerPool

_pools: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    """One live pool at a time: switching sizes closes the previous pool (2 cores, little RAM)."""
    pool = _pools.get(world_size)
    if pool is not None and not pool.broken:
        return pool
    for size in list(_pools):
        _pools.pop(size).close()
    pool = _pools[world_size] = WorkerPool(world_size)
    return pool


@pytest.fixture(scope="session")
def pools():
    yield get_pool
    for size in list(_pools):
        _pools.pop(size).close()
