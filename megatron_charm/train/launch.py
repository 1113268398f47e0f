"""Process setup: torchrun / Slurm environment, self-spawned local ranks, torch.distributed init.

``megatron-charm-train`` works three ways:

* under ``torchrun`` (or any launcher exporting ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
  ``MASTER_ADDR``/``MASTER_PORT``): it joins that job;
* under Slurm ``srun`` with several tasks: it maps ``SLURM_PROCID``/``SLURM_NTASKS``/
  ``SLURM_LOCALID`` to those variables (``MASTER_ADDR`` defaults to the first node of the job);
* otherwise: it starts ``parallel.nproc`` ranks on this machine itself and waits for them.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_charm import env
from megatron_charm.comm.topology import destroy_groups, live_process_groups
from megatron_charm.launch import LaunchSpec, free_port, run
from megatron_charm.train.config import CHARM_COMM_TYPES, Config

RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_externally(env: Mapping[str, str]) -> bool:
    """True when a launcher (torchrun, Slurm with several tasks, ...) started this rank."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return True
    return int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env


def _first_slurm_host(env: Mapping[str, str]) -> str:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if nodelist:
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            ).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
        # "node[01-04],other" -> "node01": good enough for the common single-range case.
        head = nodelist.split(",")[0]
        if "[" in head:
            base, rest = head.split("[", 1)
            return base + rest.rstrip("]").split(",")[0].split("-")[0]
        return head
    return "127.0.0.1"


def apply_slurm_env(env: MutableMapping[str, str]) -> None:
    """Fill torch.distributed's variables from Slurm's when Slurm started several tasks."""
    if "RANK" in env or int(env.get("SLURM_NTASKS", "1")) <= 1 or "SLURM_PROCID" not in env:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    if "SLURM_NTASKS_PER_NODE" in env:
        env.setdefault("LOCAL_WORLD_SIZE", env["SLURM_NTASKS_PER_NODE"].split("(")[0])
    env.setdefault("MASTER_ADDR", _first_slurm_host(env))
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))


def spawn_local_ranks(nproc: int, argv: Sequence[str], module: str) -> int:
    """Run ``python -m module argv`` as ``nproc`` local ranks; return the job's exit status.

    Fail-fast and signals as in :mod:`megatron_charm.launch.run`: when one rank fails the others
    are stopped and the status is the failing rank's (128 + signal number when a signal killed
    it); Ctrl-C gives 130; SIGTERM or SIGHUP stop every rank, then end this process as they
    would have without it. A training run has no overall time limit.
    """
    spec = LaunchSpec(cmd=[sys.executable, "-m", module, *argv], nproc=nproc, timeout_s=None)
    try:
        result = run(spec)
    except KeyboardInterrupt:
        return 130
    why = result.error()
    if why is None:
        return 0
    print(f"[megatron-charm] {why}", file=sys.stderr, flush=True)
    code = result.ranks[result.first_failure].returncode or 1
    return code if code > 0 else 128 - code


@dataclass
class DistContext:
    """What the training loop needs to know about the job."""

    on_gpu: bool
    device: torch.device
    global_rank: int
    world_size: int
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int
    dp_cp_group: dist.ProcessGroup


def use_gpu(device: str | None = None) -> bool:
    """GPU when CUDA is available, unless ``device`` is ``"cpu"`` (the trainer passes
    ``MEGATRON_CHARM_DEVICE``, :func:`megatron_charm.env.device`)."""
    return torch.cuda.is_available() and device != "cpu"


_RUN_GROUPS: list[dist.ProcessGroup] = []
"""The process groups that the last :func:`setup_distributed` of this process created."""


def _process_groups() -> set[dist.ProcessGroup]:
    """Every process group this process is a member of; where torch does not list them, none
    is found, and nothing is released."""
    return live_process_groups() or set()


def release_run_groups() -> None:
    """Destroy the process groups of the previous run in this process.

    Note [Groups of a run]
    ~~~~~~~~~~~~~~~~~~~~~~
    Every run builds Megatron's model-parallel groups and the CHARM+ channels: 21 process
    groups on 4 CPU ranks. ``destroy_model_parallel`` forgets Megatron's but destroys none, so
    each further :func:`megatron_charm.train.train` in one process (a notebook, a sweep, a
    test's pool of ranks) kept every earlier run's groups: on gloo 114 more open files a run
    on 4 ranks (past the usual limit of 1,024 after 8 runs), and collectives slowed as the
    groups piled up (a 5-iteration run took 1.2 s, then 3.4 s at the eighth). A setup therefore
    destroys the groups that the previous setup created, and no others: groups of the user's
    own stay. All ranks pass here together, before the new groups are built.
    """
    # a group that is gone already (``destroy_process_group()`` of the whole world, which
    # the command does at its end) is skipped
    destroy_groups(reversed(_RUN_GROUPS))
    _RUN_GROUPS.clear()


def setup_distributed(cfg: Config) -> DistContext:
    """Initialise torch.distributed (if needed) and megatron-core's parallel state for ``cfg``."""
    from megatron.core import parallel_state

    on_gpu = use_gpu(env.device())
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    if on_gpu:
        from megatron_charm.device import set_cuda_device_from_env

        set_cuda_device_from_env()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            # A single rank without a launcher (tests, notebooks): a private rendezvous.
            os.environ.update(
                RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
            )
        dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timeout)
    world = dist.get_world_size()
    cp = cfg.parallel.context_parallel_size
    if world % cp != 0:
        raise ValueError(
            f"parallel.context_parallel_size={cp} does not divide the number of ranks {world}. "
            f"Start a multiple of {cp} ranks (parallel.nproc, torchrun --nproc-per-node, or "
            "Slurm tasks), or change parallel.context_parallel_size."
        )
    dp = world // cp
    t = cfg.train
    if t.global_batch_size % (t.micro_batch_size * dp) != 0:
        raise ValueError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp}."
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    from megatron_charm.megatron import build_charm_groups, clear_topology_cache

    clear_topology_cache()
    release_run_groups()
    before = _process_groups()
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            context_parallel_size=cp,
            hierarchical_context_parallel_sizes=cfg.parallel.hierarchical_context_parallel_sizes,
            distributed_timeout_minutes=max(1, int(cfg.parallel.timeout_s // 60)),
            # The default backend already is gloo on CPU; extra gloo groups would only cost time.
            create_gloo_process_groups=on_gpu,
        )
        if cfg.parallel.cp_comm_type in CHARM_COMM_TYPES:
            # Here every rank passes, before any model is built; CHARM+ communication gets the same
            # timeout as every other collective of the run.
            build_charm_groups(
                ranks_per_node=cfg.parallel.ranks_per_node,
                hierarchical_cp_sizes=cfg.parallel.hierarchical_context_parallel_sizes,
                node_split=cfg.parallel.node_split,
                timeout_s=cfg.parallel.timeout_s,
            )
    finally:  # a failed setup's groups are released by the next one too
        _RUN_GROUPS.extend(pg for pg in _process_groups() if pg not in before)
    return DistContext(
        on_gpu=on_gpu,
        device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"),
        global_rank=dist.get_rank(),
        world_size=world,
        cp_size=cp,
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_size=dp,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
