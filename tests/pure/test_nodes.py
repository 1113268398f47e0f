"""The NUMA node split on fake hosts (Note [NUMA split] in megatron_charm/nodes.py)."""

from __future__ import annotations

import pytest

from megatron_charm.nodes import (
    GpuPlacement,
    node_identity,
    numa_domains,
    parse_pci,
    sysfs_numa_node,
)


def _pci(i: int) -> tuple[int, int, int]:
    return (0, 0x10 + i, 0)


def pcie_box(n: int = 8, sockets: int = 2) -> list[GpuPlacement]:
    """The paper's L20 servers: no NVLink, half the GPUs under each socket."""
    return [GpuPlacement(_pci(i), i * sockets // n, frozenset()) for i in range(n)]


def nvswitch_box(n: int = 8) -> list[GpuPlacement]:
    """DGX-like: every GPU reaches the same NVSwitches, GPUs spread over two sockets."""
    switches = frozenset({(0, 0xE0, 0), (0, 0xE1, 0)})
    return [GpuPlacement(_pci(i), i * 2 // n, switches) for i in range(n)]


def test_pcie_box_splits_by_socket():
    domains = numa_domains(pcie_box())
    assert [domains[_pci(i)] for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert node_identity("h", "numa", _pci(1), lambda: pcie_box()) == "h/numa0"
    assert node_identity("h", "numa", _pci(6), lambda: pcie_box()) == "h/numa1"


def test_nvswitch_box_is_one_node_across_sockets():
    assert set(numa_domains(nvswitch_box()).values()) == {0}
    assert node_identity("h", "numa", _pci(7), nvswitch_box) == "h"


def test_nvlink_pairs_join_across_sockets_and_rest_by_socket():
    # GPUs 0-3 on socket 0, 4-7 on socket 1; a direct NVLink bridge joins 3 and 4.
    gpus = pcie_box()
    gpus[3] = GpuPlacement(_pci(3), 0, frozenset({_pci(4)}))
    gpus[4] = GpuPlacement(_pci(4), 1, frozenset({_pci(3)}))
    domains = numa_domains(gpus)
    assert domains[_pci(3)] == domains[_pci(4)] == 0
    assert {domains[_pci(i)] for i in (0, 1, 2)} == {0}
    assert {domains[_pci(i)] for i in (5, 6, 7)} == {1}
    # Bridged pairs within a socket: the socket is still the node (pairs are named by it).
    pairs = [GpuPlacement(_pci(i), i // 4, frozenset({_pci(i ^ 1)})) for i in range(8)]
    assert [numa_domains(pairs)[_pci(i)] for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_host_split_never_probes():
    def probe():
        raise AssertionError("the host split must not read the GPUs")

    assert node_identity("node-a", "host", _pci(0), probe) == "node-a"


def test_errors_name_the_setting():
    with pytest.raises(ValueError, match="node_split='socket'.*host, numa"):
        node_identity("h", "socket")
    with pytest.raises(ValueError, match="no CUDA device.*node_split='host'"):
        node_identity("h", "numa", None, pcie_box)
    with pytest.raises(ValueError, match="0000:99:00.0 is not among"):
        node_identity("h", "numa", (0, 0x99, 0), pcie_box)
    with pytest.raises(ValueError, match="PCI address"):
        parse_pci("3b:00")


def test_pci_spellings_agree():
    assert parse_pci("0000:3b:00.0") == parse_pci("00000000:3B:00.0") == (0, 0x3B, 0)


def test_sysfs_numa_node(tmp_path):
    dev = tmp_path / "0000:3b:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    assert sysfs_numa_node((0, 0x3B, 0), tmp_path) == 1
    (dev / "numa_node").write_text("-1\n")
    assert sysfs_numa_node((0, 0x3B, 0), tmp_path) == 0
    assert sysfs_numa_node((0, 0x3C, 0), tmp_path) == 0
