"""Run a command as the ranks of a testbed, each inside its node's namespace (torchrun-like env)."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from megatron_charm.constants import DEFAULT_TIMEOUT_S
from megatron_charm.launch import LaunchSpec, describe_exit, run
from megatron_charm.testbed.config import (
    TestbedConfig,
    namespace,
    rank_address,
    rank_ifname,
)
from megatron_charm.testbed.net import TestbedError


@dataclass
class RankResult:
    """How one rank ended."""

    global_rank: int
    node: int
    local: int
    returncode: int | None
    """Exit status (negative: killed by that signal); ``None`` only if it could not be reaped."""
    killed: bool = False
    """The launcher stopped it (another rank failed, timeout or interrupt)."""
    stdout: str | None = None
    """Captured output when the run captured it."""
    stderr: str | None = None


@dataclass
class RunResult:
    """Outcome of one launch."""

    ranks: list[RankResult]
    elapsed_s: float
    timed_out: bool = False
    first_failure: int | None = None
    """Rank whose non-zero exit made the launcher stop the others."""
    log_dir: str | None = None
    cmd: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    def check(self) -> RunResult:
        """Raise ``TestbedError`` unless every rank exited 0; returns ``self`` otherwise."""
        if self.ok:
            return self
        if self.timed_out:
            why = f"timed out after {self.elapsed_s:.1f} s"
        else:
            bad = next(r for r in self.ranks if r.global_rank == self.first_failure)
            why = f"rank {bad.global_rank} {describe_exit(bad.returncode)}"
            if bad.stderr:
                why += ":\n" + bad.stderr[-2000:]
        where = f" (logs in {self.log_dir})" if self.log_dir else ""
        raise TestbedError(f"{' '.join(self.cmd)}: {why}{where}")


def rank_env(
    cfg: TestbedConfig,
    global_rank: int,
    node: int,
    local: int,
    world_size: int,
    local_world_size: int,
    master: tuple[str, int],
    link_info: Mapping[str, str],
) -> dict[str, str]:
    """Environment of one rank.

    ``GLOO_SOCKET_IFNAME`` names the rank's own interface, so gloo binds to and advertises the
    rank's address: peers on the same node reach it through the node's loopback, peers on other
    nodes through the shaped veth. ``MEGATRON_CHARM_NODE_ID`` is the namespace name, because all
    namespaces share the host name that node detection would otherwise use.
    """
    env = {
        "RANK": str(global_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node),
        "NODE_RANK": str(node),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "GLOO_SOCKET_IFNAME": rank_ifname(local),
        "TP_SOCKET_IFNAME": rank_ifname(local),
        "MEGATRON_CHARM_NODE_ID": namespace(cfg.name, node),
        "MEGATRON_CHARM_TESTBED_ADDR": rank_address(node, local),
    }
    env.update(link_info)
    return env


def launch(
    cfg: TestbedConfig,
    cmd: Sequence[str],
    *,
    placements: Sequence[tuple[int, int]] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    capture: bool = False,
    log_dir: str | None = None,
    link_info: Mapping[str, str] | None = None,
    master_port: int | None = None,
) -> RunResult:
    """Start ``cmd`` once per rank, inside its node's namespace, and wait for all of them.

    ``placements`` lists ``(node, local index)`` per rank (default: every slot, rank
    ``node * ranks_per_node + local``). If a rank exits non-zero, or ``timeout_s`` passes, or the
    caller is interrupted, every other rank is stopped (SIGTERM to its process group, SIGKILL after
    ``megatron_charm.launch.KILL_GRACE_S``), as :func:`megatron_charm.launch.run` does for every
    launcher of the project.
    ``capture`` keeps each rank's output in the result; ``log_dir`` writes it to
    ``rank<r>.out/.err`` there; with neither, ranks share the caller's terminal.
    """
    if not cmd:
        raise ValueError("cmd is empty: give the command each rank runs")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s!r}: must be positive")
    if placements is None:
        placements = [(n, i) for n in range(cfg.nodes) for i in range(cfg.ranks_per_node)]
    for node, local in placements:
        if not (0 <= node < cfg.nodes and 0 <= local < cfg.ranks_per_node):
            raise ValueError(
                f"placement {(node, local)!r} is outside the {cfg.nodes} x "
                f"{cfg.ranks_per_node} testbed"
            )
    world = len(placements)
    per_node = {n: sum(1 for m, _ in placements if m == n) for n, _ in placements}
    # Ports below the kernel's ephemeral range, so the store never races a client socket.
    port = master_port or int(os.environ.get("MASTER_PORT", 0)) or random.randint(20000, 30000)
    master = (rank_address(*placements[0]), port)
    own_dir = capture and log_dir is None
    if own_dir:
        log_dir = tempfile.mkdtemp(prefix="mctb-logs-")

    def env_of(global_rank: int) -> dict[str, str]:
        node, local = placements[global_rank]
        return rank_env(
            cfg, global_rank, node, local, world, per_node[node], master, link_info or {}
        )

    spec = LaunchSpec(
        cmd=list(cmd),
        nproc=world,
        master_addr=master[0],
        master_port=master[1],
        timeout_s=timeout_s,
        env=dict(env or {}),
        rank_env=env_of,
        prefix=lambda global_rank: [
            "ip",
            "netns",
            "exec",
            namespace(cfg.name, placements[global_rank][0]),
        ],
        log_dir=log_dir,
    )
    outcome = run(spec)
    results = []
    for exit_, (node, local) in zip(outcome.ranks, placements, strict=True):
        res = RankResult(exit_.global_rank, node, local, exit_.returncode, killed=exit_.killed)
        if capture:
            res.stdout = _read(os.path.join(log_dir, f"rank{exit_.global_rank}.out"))
            res.stderr = _read(os.path.join(log_dir, f"rank{exit_.global_rank}.err"))
        results.append(res)
    if own_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
        log_dir = None
    return RunResult(
        results, outcome.elapsed_s, outcome.timed_out, outcome.first_failure, log_dir, list(cmd)
    )


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
