"""The fault-injection tier: real gloo ranks killed, stalled or fed bad input or damaged files.

Run it alone with ``pytest tests/faults`` (or ``-m faults``); it is part of the default suite.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "faults: fault-injection tests (killed, stalled or disagreeing ranks)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in item.nodeid:
            item.add_marker(pytest.mark.faults)
