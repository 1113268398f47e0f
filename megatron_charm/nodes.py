"""What counts as a node: the host, or a NUMA domain of GPUs without NVLink between domains.

Note [NUMA split]
~~~~~~~~~~~~~~~~~
CHARM+ treats ranks on one node as joined by fast links and ranks on different nodes as joined by
slow ones. On a PCIe box without NVLink (the paper's L20 servers), the GPUs of one socket talk
through their PCIe switch, but the two sockets' GPUs talk through the CPUs' interconnect, which is
several times slower: the paper runs such a box as two nodes. Split by host there and CHARM+ sees
one node and runs RM+, which the paper shows losing to ring on that hardware.

``node_split="numa"`` gives every rank a node identity ``<host>/numa<k>``, where the domains are
found from the node's GPUs::

    GPUs joined by NVLink (directly or through an NVSwitch)   -> one group
    a GPU without NVLink                                      -> a group of its own
    each group is named by the smallest NUMA node of its GPUs; one name is one node

    8 x L20, PCIe, 2 sockets:    0 1 2 3 | 4 5 6 7     two domains (numa0, numa4)
    8 x H100, NVSwitch:          0 1 2 3   4 5 6 7     one domain (the host)

``node_split="host"`` (the default) keeps the host name; an explicit ``ranks_per_node`` overrides
both. Domains are read with NVML (``nvidia-ml-py``), which sees every GPU of the host whatever
``CUDA_VISIBLE_DEVICES`` hides, and the NUMA node from sysfs. Without NVML the NVLink state is
unknown, and an NVSwitch box would wrongly be split, so ``"numa"`` refuses to guess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

NODE_SPLITS: tuple[str, ...] = ("host", "numa")

PciAddress = tuple[int, int, int]
"""(domain, bus, device) of a PCI function, the part every tool spells the same way."""


@dataclass(frozen=True)
class GpuPlacement:
    """One GPU of the host, as the node split sees it."""

    pci: PciAddress
    """Its PCI address."""
    numa_node: int
    """NUMA node of its PCIe root complex (0 when the platform does not say)."""
    nvlink_peers: frozenset[PciAddress]
    """PCI addresses at the far end of its active NVLinks: GPUs, or NVSwitches."""


def check_node_split(node_split: str) -> str:
    if node_split not in NODE_SPLITS:
        raise ValueError(
            f"node_split={node_split!r} is not one of {', '.join(NODE_SPLITS)}: 'host' makes each "
            "host one node, 'numa' splits a host into NUMA domains of GPUs without NVLink between "
            "them; set charm node_split (or pass ranks_per_node explicitly)"
        )
    return node_split


def parse_pci(text: str) -> PciAddress:
    """``0000:3b:00.0`` (sysfs), ``00000000:3B:00.0`` (NVML) -> ``(0, 0x3b, 0)``."""
    try:
        domain, bus, rest = text.strip().lower().split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a PCI address of the form dddd:bb:dd.f (node_split='numa' reads "
            "them from NVML); set charm node_split='host' or ranks_per_node explicitly"
        ) from None


def numa_domains(gpus: Sequence[GpuPlacement]) -> dict[PciAddress, int]:
    """The domain of every GPU, named by the smallest NUMA node it holds (see Note [NUMA split]).

    GPUs are joined when one's NVLink reaches the other, or when both reach one address that is
    not a GPU of the list (an NVSwitch); the rest are joined by NUMA node.
    """
    parent = {g.pci: g.pci for g in gpus}

    def find(a: PciAddress) -> PciAddress:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    def join(a: PciAddress, b: PciAddress) -> None:
        parent[find(a)] = find(b)

    switches: dict[PciAddress, PciAddress] = {}
    by_numa: dict[int, PciAddress] = {}
    for g in gpus:
        for peer in g.nvlink_peers:
            if peer in parent:
                join(g.pci, peer)
            else:
                join(g.pci, switches.setdefault(peer, g.pci))
    for g in gpus:
        if not g.nvlink_peers:
            join(g.pci, by_numa.setdefault(g.numa_node, g.pci))
    names: dict[PciAddress, int] = {}
    for g in gpus:
        root = find(g.pci)
        names[root] = min(names.get(root, g.numa_node), g.numa_node)
    return {g.pci: names[find(g.pci)] for g in gpus}


def node_identity(
    host: str,
    node_split: str,
    device_pci: PciAddress | None = None,
    probe: Callable[[], list[GpuPlacement]] | None = None,
) -> str:
    """This rank's node identity under ``node_split``.

    Args:
        host: the host's identity (``megatron_charm.env.node_id()``).
        node_split: ``"host"`` or ``"numa"``.
        device_pci: PCI address of this rank's GPU (:func:`cuda_device_pci`); ``None`` on CPU.
        probe: lists the host's GPUs (default :func:`probe_gpus`, through NVML).
    """
    if check_node_split(node_split) == "host":
        return host
    if device_pci is None:
        raise ValueError(
            "node_split='numa' splits a host by the NUMA domains of its GPUs, but this rank has "
            "no CUDA device; use node_split='host' or an explicit ranks_per_node on CPU ranks"
        )
    gpus = (probe or probe_gpus)()
    domains = numa_domains(gpus)
    if device_pci not in domains:
        listed = ", ".join(format_pci(g.pci) for g in gpus) or "none"
        raise ValueError(
            f"node_split='numa': this rank's GPU at PCI {format_pci(device_pci)} is not among the "
            f"host's GPUs that NVML lists ({listed}); set charm ranks_per_node explicitly"
        )
    if len(set(domains.values())) == 1:
        return host
    return f"{host}/numa{domains[device_pci]}"


def format_pci(pci: PciAddress) -> str:
    """``(0, 0x3b, 0)`` -> ``0000:3b:00.0`` (the sysfs spelling)."""
    return f"{pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}.0"


def cuda_device_pci(device_index: int) -> PciAddress:
    """PCI address of CUDA device ``device_index`` (as this process numbers it)."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return (int(props.pci_domain_id), int(props.pci_bus_id), int(props.pci_device_id))


def sysfs_numa_node(pci: PciAddress, root: Path = Path("/sys/bus/pci/devices")) -> int:
    """NUMA node of a PCI device from sysfs; 0 where the platform reports none (-1) or no file."""
    try:
        node = int((root / format_pci(pci) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return 0
    return max(node, 0)


def probe_gpus(nvml=None, numa_of: Callable[[PciAddress], int] = sysfs_numa_node):
    """Every GPU of the host with its NUMA node and NVLink peers, through NVML.

    ``nvml``: the ``pynvml`` module (imported when ``None``; it comes with ``nvidia-ml-py``).
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            raise ValueError(
                "node_split='numa' reads the GPUs' NVLinks with NVML, but pynvml is not "
                "installed; pip install nvidia-ml-py, or set charm ranks_per_node explicitly"
            ) from None
    nvml.nvmlInit()
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            pci = parse_pci(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
            peers = set()
            for link in range(nvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
                except nvml.NVMLError:
                    # Links past the device's count, or no NVLink at all, answer with an error.
                    continue
                peers.add(parse_pci(_text(remote.busId)))
            gpus.append(GpuPlacement(pci, numa_of(pci), frozenset(peers)))
        return gpus
    finally:
        nvml.nvmlShutdown()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
