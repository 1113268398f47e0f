"""Pure parts of the testbed: rate parsing, validation, address plan and routes (no root)."""

from __future__ import annotations

import ipaddress

import pytest

from megatron_charm.testbed.config import (
    PRESET_RATIOS,
    TestbedConfig,
    cross_links,
    format_rate,
    parse_rate,
    rank_address,
    routes,
)
from megatron_charm.testbed.net import tbf_params


@pytest.mark.parametrize(
    "text, bits",
    [
        ("20mbit", 20_000_000),
        ("1.5gbit", 1_500_000_000),
        ("500kbit", 500_000),
        ("12.5MB/s", 100_000_000),
        (" 100 Mbit ", 100_000_000),
        (2_000_000, 2_000_000),
    ],
)
def test_parse_rate(text: str | int, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["100mbps", "fast", "-3mbit", "1bit", "", True])
def test_parse_rate_rejects(text: object) -> None:
    with pytest.raises(ValueError, match="cross_rate"):
        parse_rate(text, "cross_rate")  # type: ignore[arg-type]


def test_format_rate() -> None:
    assert format_rate(100e6) == "100 Mbit/s"
    assert format_rate(1.707e9) == "1.707 Gbit/s"


def test_presets_follow_paper_table2() -> None:
    # Table 2 of the paper gives intra/cross GB/s: L20 24.0/14.7, H20 297.2/42.6, H100 365.1/42.5.
    assert PRESET_RATIOS["l20"] == pytest.approx(1.6, abs=0.05)
    assert PRESET_RATIOS["h20"] == pytest.approx(7.0, abs=0.05)
    assert PRESET_RATIOS["h100"] == pytest.approx(8.6, abs=0.05)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"nodes": 1, "cross_rate": "1gbit"}, "nodes"),
        ({"ranks_per_node": 0, "cross_rate": "1gbit"}, "ranks_per_node"),
        ({"topology": "ring", "cross_rate": "1gbit"}, "topology"),
        ({"name": "Bad-Name", "cross_rate": "1gbit"}, "name"),
        ({}, "cross_rate"),
        ({"preset": "h100", "cross_rate": "1gbit"}, "preset"),
        ({"preset": "a100"}, "preset"),
        ({"cross_rate": "1gbit", "intra_rate": "lots"}, "intra_rate"),
        ({"cross_rate": "1gbit", "cross_delay": "2 days"}, "cross_delay"),
    ],
)
def test_validate_names_the_setting(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        TestbedConfig(**kwargs).validate()


def test_shared_links_and_routes() -> None:
    cfg = TestbedConfig(nodes=3, ranks_per_node=2, topology="shared", cross_rate="1gbit")
    links = cross_links(cfg)
    assert [(lk.a, lk.b, lk.rail) for lk in links] == [(0, 1, None), (0, 2, None), (1, 2, None)]
    # Every /31 is distinct and inside 198.19.0.0/16.
    ends = [ipaddress.ip_address(lk.address(n)) for lk in links for n in (lk.a, lk.b)]
    assert len(set(ends)) == len(ends)
    assert all(e in ipaddress.ip_network("198.18.0.0/15") for e in ends)
    # Node 1 reaches each other node's /24 over the link named after that node.
    got = {dst: dev for dst, _, dev, _ in routes(cfg, 1)}
    assert got == {"198.18.1.0/24": "n0", "198.18.3.0/24": "n2"}


def test_rails_route_by_destination_rail() -> None:
    cfg = TestbedConfig(nodes=2, ranks_per_node=3, topology="rails", cross_rate="1gbit")
    assert len(cross_links(cfg)) == 3
    for dst, gateway, dev, src in routes(cfg, 0):
        rail = int(dst.split(".")[3].split("/")[0]) - 1
        assert dst == rank_address(1, rail) + "/32"
        assert dev == f"n1r{rail}"
        assert src == rank_address(0, rail)
        assert gateway.startswith("198.19.")


def test_tbf_params_hold_a_frame_and_queue() -> None:
    for rate in (8_000, 20_000_000, 10_000_000_000):
        burst, limit = tbf_params(rate, 9000)
        assert burst >= 9000 and limit >= 4 * burst
    burst, _ = tbf_params(10_000_000_000, 1500)
    assert burst >= 10e9 / 8 * 0.002  # 2 ms of traffic at high rates
