"""One way to start local ranks: :func:`run` a :class:`LaunchSpec`, or keep a :class:`RankGroup`.

Every launcher of the project (the trainer's self-spawned ranks, the benchmarks, the demo, the
testbed's network namespaces and the test pool) starts its ranks here. :func:`run_function` runs
a Python function as the ranks. See :mod:`megatron_charm.launch.run` for what happens when a rank
dies, the run times out or the launcher gets a signal.
"""

from megatron_charm.launch.call import RankInfo, package_pythonpath, run_function
from megatron_charm.launch.group import RankExit, RankGroup, describe_exit
from megatron_charm.launch.run import LaunchError, LaunchResult, run
from megatron_charm.launch.spec import ENV_INIT_METHOD, KILL_GRACE_S, LaunchSpec, free_port

__all__ = [
    "ENV_INIT_METHOD",
    "KILL_GRACE_S",
    "LaunchError",
    "LaunchResult",
    "LaunchSpec",
    "RankExit",
    "RankGroup",
    "RankInfo",
    "describe_exit",
    "free_port",
    "package_pythonpath",
    "run",
    "run_function",
]
