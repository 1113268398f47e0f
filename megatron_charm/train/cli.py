"""``megatron-charm-train``: config-driven GPT pretraining with CHARM+ context parallelism.

Usage::

    megatron-charm-train [--config configs/<name>.yaml] [options] [section.key=value ...]

Options and overrides may come in any order.

Without ``--config`` it trains the embedded default (``configs/gpt-tiny-cpu.yaml``): a tiny GPT
with CP = 4 on 4 CPU ranks (gloo). Without a launcher it starts its own ranks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_charm.train.config import Config

MODULE = "megatron_charm.train"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-charm-train",
        description="Train a GPT (megatron-core GPTModel) with CHARM+ context-parallel attention.",
        epilog="Any config key can be set as section.key=value, e.g. train.train_iters=20 "
        "model.num_query_groups=2. Flags are shortcuts for the most common keys.",
    )
    parser.add_argument(
        "--config", help="YAML config (default: the embedded configs/gpt-tiny-cpu.yaml)"
    )
    parser.add_argument(
        "--cp-comm-type",
        help="charm | rm+ | merge | ring; on GPU with Transformer Engine also p2p | a2a | "
        "all_gather (parallel.cp_comm_type)",
    )
    parser.add_argument(
        "--data-path",
        nargs="+",
        help="Megatron indexed dataset prefixes, optionally weighted (data.path); implies "
        "data.kind=indexed",
    )
    parser.add_argument("--mock-data", action="store_true", help="use MockGPTDataset")
    parser.add_argument("--run-dir", help="run directory (run.dir)")
    parser.add_argument("--train-iters", type=int, help="optimizer steps (train.train_iters)")
    parser.add_argument(
        "--nproc", type=int, help="ranks to start when not under a launcher (parallel.nproc)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint (checkpoint.resume=true)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="train from scratch into a run directory that holds an earlier run, replacing it "
        "(run.overwrite=true)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    """Flags as ``section.key=value`` overrides (applied before the positional ones)."""
    out: list[str] = []
    if args.cp_comm_type:
        out.append(f"parallel.cp_comm_type={args.cp_comm_type}")
    if args.data_path:
        out += ["data.kind=indexed", "data.path=[" + ", ".join(map(repr, args.data_path)) + "]"]
    if args.mock_data:
        out.append("data.kind=mock")
    if args.run_dir:
        out.append(f"run.dir={args.run_dir!r}")
    if args.train_iters is not None:
        out.append(f"train.train_iters={args.train_iters}")
    if args.nproc is not None:
        out.append(f"parallel.nproc={args.nproc}")
    if args.resume:
        out.append("checkpoint.resume=true")
    if args.overwrite:
        out.append("run.overwrite=true")
    return out + list(args.overrides)


def _quiet_imports() -> None:
    # megatron-core warns at import time about optional CUDA extensions that CPU runs never use.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    warnings.filterwarnings("ignore", message=".*apex.*", category=UserWarning)
    warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")


def _setup_logging(global_rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if global_rank == 0 else logging.WARNING,
        format="[megatron-charm] %(message)s",
        stream=sys.stdout,
        force=True,
    )
    # megatron-core logs every dataset cache step at INFO.
    logging.getLogger("megatron").setLevel(logging.WARNING)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags and ``section.key=value`` overrides in any order (``k=v --resume k2=v2``)."""
    return build_parser().parse_intermixed_args(list(argv))


def _error(message: object, every_rank: bool = False, status: int = 2) -> int:
    """Report an error and return the exit status.

    Checks made before training give every rank the same answer, so only rank 0 prints them.
    Errors during training may concern one rank only (its own checkpoint file), so each rank
    that hits one prints it, with its rank.
    """
    global_rank = os.environ.get("RANK", "0")
    if every_rank or global_rank == "0":
        where = f" (rank {global_rank})" if every_rank and "WORLD_SIZE" in os.environ else ""
        print(f"megatron-charm-train: error{where}: {message}", file=sys.stderr)
    return status


def preflight(cfg: Config, externally_launched: bool, environ: Mapping[str, str]) -> None:
    """Every check that can fail before a rank starts: config rules with the job's world size,
    and the run directory.

    Raises:
        ValueError: naming the setting to change.
    """
    from megatron_charm.train.rundir import check_run_dir
    from megatron_charm.train.validate import validate_config

    world = int(environ.get("WORLD_SIZE", "1")) if externally_launched else cfg.parallel.nproc
    validate_config(cfg, world)
    check_run_dir(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``megatron-charm-train`` (and ``python -m megatron_charm.train``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    _quiet_imports()
    from megatron_charm.train.config import dump_config, load_config
    from megatron_charm.train.launch import apply_slurm_env, launched_externally, spawn_local_ranks

    try:
        cfg = load_config(args.config, overrides_from_args(args))
    except (ValueError, OSError) as exc:
        return _error(exc)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    apply_slurm_env(os.environ)
    external = launched_externally(os.environ)
    try:
        preflight(cfg, external, os.environ)
    except ValueError as exc:
        return _error(exc)
    if not external and cfg.parallel.nproc > 1:
        print(
            f"[megatron-charm] starting {cfg.parallel.nproc} local ranks "
            f"(no torchrun/Slurm environment found)",
            flush=True,
        )
        return spawn_local_ranks(cfg.parallel.nproc, argv, MODULE)

    _setup_logging(int(os.environ.get("RANK", "0")))
    import torch

    if not torch.cuda.is_available():
        # Ranks share the cores; oversubscribing threads slows every rank down.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from megatron_charm.comm.executor import DistributedError
    from megatron_charm.train.loop import train

    try:
        result = train(cfg)
    except ValueError as exc:
        return _error(exc, every_rank=True)
    except DistributedError as exc:
        # A peer died or stalled: the launcher names the rank that failed first; this rank only
        # says what it saw, without a traceback through the executor.
        return _error(exc, every_rank=True, status=1)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0 and len(result.losses) >= 2:
        print(
            f"[megatron-charm] done: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} over "
            f"iterations {result.start_iteration + 1}-{result.final_iteration}; metrics in "
            f"{cfg.run_dir / 'metrics.jsonl'}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
