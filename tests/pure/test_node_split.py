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


class _FakeTopology:
    built: list[dict] = []

    @classmethod
    def build(cls, cp_group, **kwargs):
        cls.built.append(kwargs)
        return cls()


@pytest.fixture
def fake_dist(monkeypatch):
    """A CP group of 4 without process groups: what get_charm_topology reads of the library."""
    import megatron_charm
    from megatron_charm.megatron import groups

    monkeypatch.setattr(groups.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(groups.dist, "get_process_group_ranks", lambda group: [0, 1, 2, 3])
    monkeypatch.setattr(groups.dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(megatron_charm, "CPTopology", _FakeTopology)
    monkeypatch.setattr(groups, "_numa_node_id", lambda: "host-a/numa1")
    monkeypatch.setattr(groups, "_TOPOLOGIES", {})
    _FakeTopology.built.clear()
    return groups


def test_numa_split_gives_the_topology_a_numa_node_identity(fake_dist, monkeypatch):
    pgs = type("PGs", (), {"cp": object()})()
    fake_dist.get_charm_topology(pgs, node_split="numa")
    assert _FakeTopology.built[-1]["node_id"] == "host-a/numa1"
    # host split: a second topology, the entry point's node identity (env.node_id(): the
    # hostname unless MEGATRON_CHARM_NODE_ID names one), passed down as an argument
    monkeypatch.setenv("MEGATRON_CHARM_NODE_ID", "host-b")
    fake_dist.get_charm_topology(pgs)
    assert _FakeTopology.built[-1]["node_id"] == "host-b" and len(_FakeTopology.built) == 2
    fake_dist.get_charm_topology(pgs, ranks_per_node=2, node_split="numa")  # explicit wins
    assert _FakeTopology.built[-1]["node_id"] == "host-b"
    assert _FakeTopology.built[-1]["ranks_per_node"] == 2


def test_unknown_node_split_is_refused(fake_dist):
    with pytest.raises(ValueError, match="node_split='socket'"):
        fake_dist.get_charm_topology(type("PGs", (), {"cp": object()})(), node_split="socket")


def test_numa_split_on_a_cpu_rank_names_the_way_out():
    from megatron_charm.megatron import groups

    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA present: this checks the CPU refusal")
    with pytest.raises(ValueError, match="no CUDA device.*node_split='host'"):
        groups._numa_node_id()
