"""Performing the planned runs: each one a ``megatron-charm-train`` invocation.

Launchers: ``fork`` (ranks forked from this process, which imported the trainer once),
``local`` (one ``python -m megatron_charm.train`` per run, which starts its own ranks),
``torchrun`` and ``slurm`` (the scripts in ``scripts/launch/``), and ``testbed`` (every rank of
``python -m megatron_charm.train`` in its emulated node, with a rate-shaped link between nodes:
:mod:`megatron_charm.testbed`, root).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_charm.bench.tables.collect import is_complete
from megatron_charm.bench.tables.plan import REPO, Run, Scale

TRAIN_MODULE = "megatron_charm.train"


def trainer_argv(run: Run) -> list[str]:
    """Arguments of ``megatron-charm-train`` for a run (the config as an absolute path)."""
    return ["--config", str(REPO / run.config), *run.overrides]


def launch_command(run: Run, launcher: str, scale: Scale, sbatch_args: Sequence[str]) -> list[str]:
    """The shell command that performs ``run`` with ``launcher``."""
    argv = trainer_argv(run)
    if launcher in ("local", "fork", "testbed"):
        return [sys.executable, "-m", TRAIN_MODULE, *argv]
    # At --scale cpu the nodes are emulated (parallel.ranks_per_node): every rank runs on one
    # machine. At --scale gpu each node runs ranks_per_node ranks, one per GPU.
    emulated = scale.name == "cpu"
    per_node = scale.world_size if emulated else scale.ranks_per_node
    if launcher == "torchrun":
        # One node per invocation: for several nodes run this script on each with NNODES,
        # MASTER_ADDR and RDZV_ID set (scripts/launch/torchrun_train.sh joins them).
        script = str(REPO / "scripts/launch/torchrun_train.sh")
        return ["bash", script, "--nproc", str(per_node), *argv[1:]]
    if launcher == "slurm":
        script = str(REPO / "scripts/launch/slurm_train.sbatch")
        where = (
            ["--nodes=1", f"--cpus-per-task={per_node}"]
            if emulated
            else [f"--nodes={scale.nodes}", f"--gpus-per-node={per_node}"]
        )
        return [
            "sbatch",
            "--wait",
            f"--job-name={run.run_id}",
            *where,
            "--ntasks-per-node=1",
            # torchrun mode of the sbatch script: one torchrun per node starts the node's ranks.
            f"--export=ALL,NPROC_PER_NODE={per_node}",
            f"--output={run.run_dir}/slurm-%j.out",
            *sbatch_args,
            script,
            *argv[1:],
        ]
    raise ValueError(
        f"unknown launcher {launcher!r}: expected one of fork, local, torchrun, slurm, testbed; "
        "pass --launcher with one of them"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ForkRunner:
    """Runs the trainer's entry point in ranks forked from a process that imported it once.

    Each run is ``megatron_charm.train.cli.main(argv)`` with the very argv of the command line,
    in ``nproc`` freshly forked ranks with their own rendezvous port, exactly as the trainer's
    own launcher sets them up. Forking skips the import of torch and megatron-core per rank
    (tens of seconds per run on 2 cores); a fresh process per run keeps peak-memory readings
    (``ru_maxrss``) per run instead of per pool.
    """

    def __init__(self) -> None:
        # Keep the parent single-threaded before forking: a started OpenMP pool does not
        # survive fork.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import warnings

        warnings.filterwarnings("ignore")
        import torch

        torch.set_num_threads(1)
        # Imported once here, so that the forked ranks find them loaded.
        import megatron.core.models.gpt  # noqa: F401

        import megatron_charm.megatron  # noqa: F401
        from megatron_charm.train import cli, loop  # noqa: F401

    def run(self, run: Run, nproc: int, log: Path, timeout_s: float) -> int:
        argv = trainer_argv(run)
        port = _free_port()
        pids = []
        with log.open("w") as out:
            out.write("$ " + shlex.join([sys.executable, "-m", TRAIN_MODULE, *argv]) + "\n")
            out.flush()
            for global_rank in range(nproc):
                pid = os.fork()
                if pid == 0:  # the rank
                    code = 1
                    try:
                        os.dup2(out.fileno(), 1)
                        os.dup2(out.fileno(), 2)
                        os.environ.update(
                            RANK=str(global_rank),
                            WORLD_SIZE=str(nproc),
                            LOCAL_RANK=str(global_rank),
                            LOCAL_WORLD_SIZE=str(nproc),
                            MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port),
                        )
                        from megatron_charm.train.cli import main

                        code = main(argv)
                    except BaseException:  # noqa: BLE001 - report, then leave the child
                        import traceback

                        traceback.print_exc()
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                pids.append(pid)
        return _wait_all(pids, timeout_s)


def _wait_all(pids: list[int], timeout_s: float) -> int:
    """Wait for the ranks; the first failure (or the timeout) stops the others."""
    status = 0
    deadline = time.monotonic() + timeout_s
    live = set(pids)
    while live:
        for pid in list(live):
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                live.discard(pid)
                code = os.waitstatus_to_exitcode(raw)
                if code != 0 and status == 0:
                    status = code if code > 0 else 128 - code
                    _kill(live)
        if live and time.monotonic() > deadline:
            status = status or 124
            _kill(live)
        time.sleep(0.1)
    return status


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _testbed_run(testbed, cmd: list[str], run: Run, log: Path, timeout_s: float) -> int:
    """One run as the testbed's ranks; rank 0's output becomes the run's log."""
    ranks = run.run_dir / "ranks"
    from megatron_charm.launch import package_pythonpath

    env = {"PYTHONPATH": package_pythonpath()}
    res = testbed.run(cmd, timeout_s=timeout_s, env=env, log_dir=str(ranks))
    with log.open("w") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        for name in ("rank0.out", "rank0.err"):
            if (ranks / name).exists():
                out.write((ranks / name).read_text())
    if res.timed_out:
        return 124
    return next((r.returncode or 1 for r in res.ranks if r.returncode != 0), 0)


def execute(
    runs: Sequence[Run],
    launcher: str,
    scale: Scale,
    sbatch_args: Sequence[str],
    timeout_s: float,
    skip_existing: bool,
    testbed=None,
) -> dict[str, str]:
    """Perform the runs one after another; returns run id -> error for the failed ones.
    ``testbed``: an up :class:`megatron_charm.testbed.Testbed` for ``launcher="testbed"``."""
    errors: dict[str, str] = {}
    runner = ForkRunner() if launcher == "fork" else None
    # Multi-node torchrun: this script runs on every node at once, and a node must not delete
    # the file that rank 0 (on the first node) is writing.
    shared_by_nodes = launcher == "torchrun" and int(os.environ.get("NNODES", "1")) > 1
    for i, run in enumerate(runs, 1):
        if skip_existing and is_complete(run, scale):
            print(f"[{i}/{len(runs)}] {run.run_id}: complete, skipped", flush=True)
            continue
        run.run_dir.mkdir(parents=True, exist_ok=True)
        if not shared_by_nodes:
            # A stale file from an earlier attempt must not pass for this run's result.
            (run.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        log = run.run_dir / "train.log"
        began = time.monotonic()
        print(f"[{i}/{len(runs)}] {run.run_id} ...", end="", flush=True)
        if runner is not None:
            code = runner.run(run, scale.world_size, log, timeout_s)
        elif launcher == "testbed":
            cmd = launch_command(run, launcher, scale, sbatch_args)
            code = _testbed_run(testbed, cmd, run, log, timeout_s)
        else:
            cmd = launch_command(run, launcher, scale, sbatch_args)
            env = dict(os.environ)
            env.setdefault("PYTHON", sys.executable)
            with log.open("w") as out:
                out.write("$ " + shlex.join(cmd) + "\n")
                out.flush()
                try:
                    code = subprocess.run(
                        cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
                    ).returncode
                except subprocess.TimeoutExpired:
                    code = 124
        took = time.monotonic() - began
        if code != 0:
            errors[run.run_id] = f"exit status {code}; see {log}"
            print(f" FAILED ({took:.0f} s, exit status {code}; log: {log})", flush=True)
        else:
            print(f" ok ({took:.0f} s)", flush=True)
    return errors
