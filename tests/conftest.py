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


def _pool_size(item: pytest.Item) -> int:
    """The world size a test asks its pool for: its ``n`` parameter, else the suite's usual 4."""
    callspec = getattr(item, "callspec", None)
    n = callspec.params.get("n") if callspec is not None else None
    return n if isinstance(n, int) else 4


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Only one pool lives at a time (get_pool), and starting one costs about 1.5 CPU-seconds per
    # rank: parametrizations that alternate sizes (4, 6, 8, 4, ...) restart it at every test.
    # Run each module's pool tests grouped by size, modules and the order within a size kept.
    modules: dict[str, int] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], len(modules))

    def key(pair: tuple[int, pytest.Item]) -> tuple[int, int, int]:
        index, item = pair
        pooled = "pools" in getattr(item, "fixturenames", ())
        return modules[item.nodeid.split("::")[0]], _pool_size(item) if pooled else 0, index

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


# Module scope: idle gloo ranks still cost CPU, so a pool does not outlive its test module.
@pytest.fixture(scope="module")
def pools():
    yield get_pool
    for size in list(_pools):
        _pools.pop(size).close()
