"""Node layout detection (pure part of CPTopology)."""

from __future__ import annotations

import pytest

from megatron_charm.comm.topology import layout_from_nodes
from megatron_charm.plan import Layout


def test_detects_equal_contiguous_nodes():
    assert layout_from_nodes(["a", "a", "b", "b"], None) == Layout(2, 2)
    assert layout_from_nodes(["a"] * 8, None) == Layout(1, 8)
    assert layout_from_nodes(["a", "b", "c"], None) == Layout(3, 1)


def test_explicit_ranks_per_node_overrides_detection():
    assert layout_from_nodes(["a"] * 8, 4) == Layout(2, 4)
    with pytest.raises(ValueError, match="ranks_per_node=3 must be >= 1 and divide the CP size 8"):
        layout_from_nodes(["a"] * 8, 3)


def test_rejects_unequal_or_interleaved_nodes():
    with pytest.raises(ValueError, match="unequal numbers of CP ranks"):
        layout_from_nodes(["a", "a", "a", "b"], None)
    with pytest.raises(ValueError, match="not contiguous"):
        layout_from_nodes(["a", "b", "a", "b"], None)


def test_ranks_per_node_must_be_an_integer():
    with pytest.raises(ValueError, match="ranks_per_node='2' must be an integer"):
        layout_from_nodes(["a"] * 4, "2")  # type: ignore[arg-type]
