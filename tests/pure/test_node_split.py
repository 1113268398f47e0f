"""How the CHARM+ node split is derived from Megatron's settings (pure)."""

from __future__ import annotations

import pytest

from megatron_charm.megatron import ENV_RANKS_PER_NODE, resolve_node_split


def test_precedence_explicit_then_env_then_hierarchical_then_detection():
    env = {ENV_RANKS_PER_NODE: "4"}
    assert resolve_node_split(8, 2, [4, 2], env).ranks_per_node == 2
    assert resolve_node_split(8, None, [2, 4], env).ranks_per_node == 4
    split = resolve_node_split(8, None, [2, 4], {})
    assert (split.ranks_per_node, split.source) == (2, "hierarchical_context_parallel_sizes")
    split = resolve_node_split(8, None, None, {})
    assert split.ranks_per_node is None and "hostnames" in split.source


@pytest.mark.parametrize(
    "args,fragment",
    [
        ((8, 3, None, {}), "does not divide"),
        ((8, None, None, {ENV_RANKS_PER_NODE: "two"}), ENV_RANKS_PER_NODE),
        ((8, None, None, {ENV_RANKS_PER_NODE: "3"}), "does not divide"),
        ((8, None, [2, 2], {}), "--hierarchical-context-parallel-sizes"),
        ((8, None, [2, 2, 2], {}), "exactly two levels"),
        ((8, 0, None, {}), "positive integer"),
    ],
)
def test_bad_splits_name_the_setting(args, fragment):
    with pytest.raises(ValueError) as info:
        resolve_node_split(*args)
    assert fragment in str(info.value)
