import pytest

from tests.rank_pool import RankPool

_pools: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    """One live pool at a time: switching sizes closes the previous pool (2 cores, little RAM)."""
    pool = _pools.get(world_size)
    if pool is not None and not pool.broken:
        return pool
    for size in list(_pools):
        _pools.pop(size).close()
    pool = _pools[world_size] = RankPool(world_size, context=True)
    return pool


# Module scope: idle gloo ranks still cost CPU, so a pool does not outlive its test module.
@pytest.fixture(scope="module")
def pools():
    yield get_pool
    for size in list(_pools):
        _pools.pop(size).close()
