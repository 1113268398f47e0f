"""Testbed configuration: rates, presets, names and the address plan (pure, no root needed).

Address plan (all inside namespaces the testbed creates, never on the host):

* rank ``(node A, local index i)`` owns ``198.18.<A+1>.<i+1>/32`` on its own interface ``r<i>``;
  the node's ranks together form ``198.18.<A+1>.0/24``;
* every cross-node link is a veth pair with a ``/31`` from ``198.19.0.0/16``.

198.18.0.0/15 is reserved for network benchmarking (RFC 2544), so it cannot clash with a real
network the host might route to.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass, field

#: Every namespace the testbed creates starts with this, so leftovers can be found and removed.
NAME_PREFIX = "mctb-"

TOPOLOGIES = ("shared", "rails")

#: intra:cross unidirectional bandwidth ratios from the paper's Table 2 (GB/s, intra / cross).
PRESET_RATIOS: dict[str, float] = {
    "l20": 24.0 / 14.7,
    "h20": 297.2 / 42.6,
    "h100": 365.1 / 42.5,
}

MAX_NODES = 16
MAX_RANKS_PER_NODE = 64

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_BYTE_UNITS = {"b/s": 8, "kb/s": 8 * 10**3, "mb/s": 8 * 10**6, "gb/s": 8 * 10**9}
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z/]+)\s*$")
_DELAY_RE = re.compile(r"^[0-9]*\.?[0-9]+(us|ms|s)$")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,15}$")


def parse_rate(value: str | int | float, setting: str = "rate") -> int:
    """Parse a link rate into bits per second.

    Accepts ``int``/``float`` (bits per second), tc-style bit units (``20mbit``, ``1.5gbit``; SI
    multiples) and byte rates written with a slash (``12.5MB/s``). ``mbps``-style spellings are
    refused because tc reads them as *bytes* per second while most people mean bits.
    """
    if isinstance(value, bool):
        raise ValueError(f"{setting}={value!r}: a rate must be a number or a string like '100mbit'")
    if isinstance(value, (int, float)):
        bits = float(value)
    else:
        match = _RATE_RE.match(value.lower())
        if not match:
            raise ValueError(
                f"{setting}={value!r}: expected a rate like '100mbit', '2.5gbit' or '12.5MB/s'"
            )
        number, unit = float(match.group(1)), match.group(2)
        if unit in _UNITS:
            bits = number * _UNITS[unit]
        elif unit in _BYTE_UNITS:
            bits = number * _BYTE_UNITS[unit]
        else:
            raise ValueError(
                f"{setting}={value!r}: unknown unit {unit!r}; use bit/kbit/mbit/gbit or "
                "B/s, kB/s, MB/s, GB/s ('mbps' is ambiguous: tc reads it as bytes)"
            )
    if not bits >= 8_000:
        raise ValueError(f"{setting}={value!r}: the rate must be at least 8kbit (1000 bytes/s)")
    return int(bits)


def format_rate(bits_per_s: float) -> str:
    """Human-readable rate, e.g. ``'100 Mbit/s'``."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.4g} {unit}"
    return f"{bits_per_s:.4g} bit/s"


@dataclass
class TestbedConfig:
    """Shape and link rates of an emulated machine of ``nodes x ranks_per_node`` ranks."""

    __test__ = False  # not a pytest test class despite the name

    nodes: int = 2
    """Number of emulated nodes (network namespaces)."""
    ranks_per_node: int = 1
    """Ranks per node; each gets its own address inside the node's namespace."""
    topology: str = "shared"
    """``shared``: one cross link per node pair; ``rails``: one per node pair and local index."""
    cross_rate: str | int | None = None
    """Rate of every cross-node link per direction (e.g. ``'100mbit'``); ``None`` with a preset."""
    intra_rate: str | int | None = None
    """Optional cap on each node's intra-node traffic (tbf on its loopback); ``None``: unshaped."""
    cross_delay: str | None = None
    """Optional one-way delay on cross links (``'1ms'``, ``'200us'``). Needs the netem qdisc,
    which many kernels lack; the testbed then refuses instead of silently ignoring it."""
    preset: str | None = None
    """``l20``/``h20``/``h100``: cross rate = intra bandwidth / the paper's Table 2 ratio."""
    ack_priority: bool = True
    """Send small TCP packets (acknowledgements) ahead of queued data on every shaped link, so
    that traffic in one direction does not slow the other (Note [Acknowledgements first] in
    :mod:`megatron_charm.testbed.net`). ``False``: one queue, as testbeds before 2026-12-03."""
    name: str = field(default_factory=lambda: f"p{os.getpid()}")
    """Instance name; namespaces are ``mctb-<name>-n<node>`` (a-z, 0-9, ``_``). The default
    comes from the process id, so concurrent users do not collide."""
    extra: dict = field(default_factory=dict)
    """Free-form notes stored with the testbed state (e.g. the measured intra bandwidth)."""

    def validate(self) -> None:
        """Raise ``ValueError`` for any setting out of range."""
        if not isinstance(self.nodes, int) or not 2 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes={self.nodes!r}: must be an integer in [2, {MAX_NODES}]")
        if not isinstance(self.ranks_per_node, int) or not (
            1 <= self.ranks_per_node <= MAX_RANKS_PER_NODE
        ):
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node!r}: must be an integer in "
                f"[1, {MAX_RANKS_PER_NODE}]"
            )
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology={self.topology!r}: must be one of {TOPOLOGIES}")
        if not _NAME_RE.match(self.name):
            raise ValueError(
                f"name={self.name!r}: use 1-16 characters from a-z, 0-9 and '_' "
                "(it becomes part of namespace names)"
            )
        if self.preset is not None:
            if self.preset not in PRESET_RATIOS:
                raise ValueError(f"preset={self.preset!r}: must be one of {sorted(PRESET_RATIOS)}")
            if self.cross_rate is not None:
                raise ValueError(
                    "cross_rate and preset are both set: the preset derives the cross rate; "
                    "drop one of them"
                )
        elif self.cross_rate is None:
            raise ValueError("cross_rate is not set: give a rate such as '100mbit' or a preset")
        if self.cross_rate is not None:
            parse_rate(self.cross_rate, "cross_rate")
        if self.intra_rate is not None:
            parse_rate(self.intra_rate, "intra_rate")
        if self.cross_delay is not None and not _DELAY_RE.match(self.cross_delay):
            raise ValueError(
                f"cross_delay={self.cross_delay!r}: expected a delay like '1ms', '200us' or '0.5s'"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TestbedConfig:
        return cls(**data)


def namespace(name: str, node: int) -> str:
    """Namespace of ``node`` in testbed ``name``."""
    return f"{NAME_PREFIX}{name}-n{node}"


def rank_address(node: int, local: int) -> str:
    """Address a rank binds to (``198.18.<node+1>.<local+1>``)."""
    return f"198.18.{node + 1}.{local + 1}"


def node_subnet(node: int) -> str:
    return f"198.18.{node + 1}.0/24"


def rank_ifname(local: int) -> str:
    """Interface that carries a rank's address (what ``GLOO_SOCKET_IFNAME`` names)."""
    return f"r{local}"


@dataclass(frozen=True)
class Link:
    """One cross-node veth pair; ``rail`` is ``None`` for the shared topology."""

    a: int
    """Lower node index."""
    b: int
    """Higher node index."""
    rail: int | None
    index: int
    """Position in the link list; selects the /31 from 198.19.0.0/16."""

    def ifname(self, node: int) -> str:
        """Name of this link's end inside ``node``'s namespace (named after the far node)."""
        other = self.b if node == self.a else self.a
        return f"n{other}" if self.rail is None else f"n{other}r{self.rail}"

    def address(self, node: int) -> str:
        base = ipaddress.IPv4Address("198.19.0.0") + 2 * self.index
        return str(base if node == self.a else base + 1)


def cross_links(cfg: TestbedConfig) -> list[Link]:
    """All cross-node links of a configuration, in a fixed order."""
    links: list[Link] = []
    rails: list[int | None] = (
        [None] if cfg.topology == "shared" else list(range(cfg.ranks_per_node))
    )
    for a in range(cfg.nodes):
        for b in range(a + 1, cfg.nodes):
            for rail in rails:
                links.append(Link(a, b, rail, len(links)))
    return links


def routes(cfg: TestbedConfig, node: int) -> list[tuple[str, str, str, str]]:
    """Routes inside ``node``: ``(destination, gateway, device, source)``.

    ``shared``: the far node's whole /24 goes over the pair's one link. ``rails``: a packet
    travels on the rail of its *destination* rank (what NCCL's PXN does: hop over the local fabric
    to the GPU on the right rail, then cross), so local index ``i`` to local index ``i`` uses rail
    ``i``. The source address is the local rank on the same rail, which keeps both directions of a
    connection on one link even when the socket was not bound.
    """
    out = []
    for link in cross_links(cfg):
        if node not in (link.a, link.b):
            continue
        far = link.b if node == link.a else link.a
        gateway, dev = link.address(far), link.ifname(node)
        if link.rail is None:
            out.append((node_subnet(far), gateway, dev, rank_address(node, 0)))
        else:
            dst = rank_address(far, link.rail) + "/32"
            out.append((dst, gateway, dev, rank_address(node, link.rail)))
    return out
