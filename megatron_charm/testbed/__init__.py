"""An emulated multi-node machine on one Linux host, for multi-rank gloo jobs.

Each node is a network namespace; ranks of a node talk over its loopback, ranks of different nodes
over veth links shaped with ``tc tbf``. See ``docs/testbed.md``.

    from megatron_charm.testbed import Testbed

    with Testbed(nodes=2, ranks_per_node=2, topology="shared", cross_rate="100mbit") as tb:
        tb.run([sys.executable, "bench.py"], timeout_s=300).check()
"""

from megatron_charm.testbed.config import PRESET_RATIOS, TestbedConfig, format_rate, parse_rate
from megatron_charm.testbed.launch import RankResult, RunResult
from megatron_charm.testbed.net import TestbedError, netem_available
from megatron_charm.testbed.testbed import Testbed, cleanup

__all__ = [
    "PRESET_RATIOS",
    "RankResult",
    "RunResult",
    "Testbed",
    "TestbedConfig",
    "TestbedError",
    "cleanup",
    "format_rate",
    "netem_available",
    "parse_rate",
]
