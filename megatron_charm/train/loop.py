"""The training loop: one loop for CPU and GPU, on megatron-core's GPTModel.

:func:`train` is :func:`~megatron_charm.train.setup.setup`, then per iteration
:func:`train_step`, :func:`log_iteration`, :func:`check_finite` and
:func:`checkpoint_and_maybe_exit`.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_charm.train import checkpoint as ckpt
from megatron_charm.train.config import Config
from megatron_charm.train.data import get_microbatch
from megatron_charm.train.launch import DistContext
from megatron_charm.train.metrics import format_line, peak_memory_mb
from megatron_charm.train.schedule import learning_rate, resolved_schedule
from megatron_charm.train.setup import Trainer, setup

logger = logging.getLogger("megatron_charm")

#: Called after gradients are reduced and before the optimizer step:
#: ``fn(iteration, model)``; tests use it to compare gradients.
GradHook = Callable[[int, torch.nn.Module], None]


@dataclass
class TrainResult:
    """What a run produced (every rank gets the same global numbers)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    """One metrics record per iteration run in this invocation."""
    start_iteration: int = 0
    """Iteration this invocation started from (non-zero after a resume)."""
    final_iteration: int = 0

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


def _local_batch(batch: dict[str, torch.Tensor], ctx: DistContext) -> dict[str, torch.Tensor]:
    """This CP rank's zigzag share of a full-sequence batch (Megatron's own slicing)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = {k: v.to(ctx.device, non_blocking=True) for k, v in batch.items()}
    # The CP group explicitly: without one, megatron-core 0.19 slices over the whole world.
    kwargs: dict[str, Any] = {"cp_group": parallel_state.get_context_parallel_group()}
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        kwargs["is_hybrid_cp"] = False  # required from megatron-core 0.19 on
    return get_batch_on_this_cp_rank(batch, **kwargs)


def train_step(trainer: Trainer, iteration: int, grad_hook: GradHook | None) -> dict[str, Any]:
    """One optimizer step (every micro-batch, gradient sync, step); returns its metrics record."""
    cfg, ctx, opt = trainer.cfg, trainer.ctx, trainer.opt
    began = time.perf_counter()
    opt.zero_grad()
    batches = [
        _local_batch(
            get_microbatch(trainer.dataset, iteration, j, cfg, ctx.dp_rank, ctx.dp_size), ctx
        )
        for j in range(trainer.num_micro)
    ]
    # Normalise by the global number of loss tokens, so summing gradients over data x context
    # parallel ranks gives exactly the gradient of the global mean loss.
    counts = torch.stack([b["loss_mask"].sum() for b in batches]).sum().float()
    dist.all_reduce(counts, group=ctx.dp_cp_group)
    loss_sum = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for batch in batches:
        per_token = opt.model(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"],
        )
        local = (per_token.float() * batch["loss_mask"]).sum()
        (local / counts).backward()
        loss_sum += local.detach()
    opt.finish_grad_sync()
    if grad_hook is not None:
        grad_hook(iteration, trainer.model)
    lr = learning_rate(trainer.schedule, iteration)
    grad_norm = opt.step(lr)
    dist.all_reduce(loss_sum, group=ctx.dp_cp_group)
    loss = float(loss_sum / counts)
    elapsed = time.perf_counter() - began
    return {
        "iteration": iteration + 1,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "iter_ms": elapsed * 1e3,
        "tokens_per_s": trainer.tokens_per_iter / elapsed,
        "tflops_per_rank": trainer.flops_per_iter / elapsed / ctx.world_size / 1e12,
        "peak_mem_mb": peak_memory_mb(ctx.on_gpu),
    }


def log_iteration(trainer: Trainer, record: dict[str, Any]) -> None:
    """Metrics file, progress thread and (every ``log_interval``) the console line."""
    done = record["iteration"]
    train_iters = trainer.cfg.train.train_iters
    trainer.progress.iteration = done
    trainer.metrics.write(record)
    if trainer.is_logger and (done % trainer.cfg.logging.log_interval == 0 or done == train_iters):
        print(format_line(record, train_iters), flush=True)


def check_finite(record: dict[str, Any]) -> None:
    """Stop on a non-finite loss instead of training on garbage."""
    loss = record["loss"]
    if not torch.isfinite(torch.tensor(loss)):
        raise FloatingPointError(
            f"loss is {loss} at iteration {record['iteration']}; lower train.lr or check the data."
        )


def checkpoint_and_maybe_exit(trainer: Trainer, done: int) -> bool:
    """Save when an interval, ``exit_interval`` or the end says so; True means stop now."""
    cfg = trainer.cfg
    t = cfg.train
    exiting = t.exit_interval is not None and done % t.exit_interval == 0
    periodic = cfg.checkpoint.save_interval and done % cfg.checkpoint.save_interval == 0
    if cfg.checkpoint.save and (periodic or exiting or done == t.train_iters):
        meta = {"schedule": resolved_schedule(trainer.schedule), "config": cfg.to_dict()}
        ckpt.save_checkpoint(cfg.checkpoint_dir, done, trainer.opt.state_dict(), meta)
        if trainer.is_logger:
            logger.info("saved checkpoint at iteration %d to %s", done, cfg.checkpoint_dir)
    if exiting and done < t.train_iters:
        if trainer.is_logger:
            logger.info("exit_interval reached at iteration %d; stopping", done)
        return True
    return False


def train(cfg: Config, grad_hook: GradHook | None = None) -> TrainResult:
    """Train ``cfg``; collective over all ranks of the job. Returns the per-iteration records."""
    trainer = setup(cfg)
    result = TrainResult(start_iteration=trainer.start, final_iteration=trainer.start)
    trainer.progress.start(trainer.start)
    trainer.model.train()
    try:
        for iteration in range(trainer.start, cfg.train.train_iters):
            record = train_step(trainer, iteration, grad_hook)
            result.records.append(record)
            result.final_iteration = record["iteration"]
            log_iteration(trainer, record)
            check_finite(record)
            if checkpoint_and_maybe_exit(trainer, record["iteration"]):
                break
    finally:
        trainer.progress.stop()
        trainer.metrics.close()
    return result
