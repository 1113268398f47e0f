"""The training loop: one loop for CPU and GPU, on megatron-core's GPTModel."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_charm.train import checkpoint as ckpt
from megatron_charm.train.config import Config, dump_config
from megatron_charm.train.data import build_train_dataset, get_microbatch
from megatron_charm.train.launch import DistContext, setup_distributed
from megatron_charm.train.metrics import (
    MetricsWriter,
    Progress,
    flops_per_iteration,
    format_line,
    peak_memory_mb,
)
from megatron_charm.train.model import build_model, count_parameters
from megatron_charm.train.optim import build_optimizer
from megatron_charm.train.schedule import learning_rate
from megatron_charm.train.tokenizer import ByteTokenizer, padded_vocab_size

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


def _dtype(cfg: Config, on_gpu: bool) -> torch.dtype:
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if on_gpu else "fp32"
    if precision == "bf16" and not on_gpu:
        raise ValueError(
            "train.precision=bf16 on CPU is not supported (CPU runs in fp32); set "
            "train.precision=auto or fp32."
        )
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _local_batch(batch: dict[str, torch.Tensor], ctx: DistContext) -> dict[str, torch.Tensor]:
    """This CP rank's zigzag share of a full-sequence batch (Megatron's own slicing)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = {k: v.to(ctx.device, non_blocking=True) for k, v in batch.items()}
    return get_batch_on_this_cp_rank(batch)


def train(cfg: Config, grad_hook: GradHook | None = None) -> TrainResult:
    """Train ``cfg``; collective over all ranks of the job. Returns the per-iteration records."""
    ctx = setup_distributed(cfg)
    is_logger = ctx.global_rank == 0
    dtype = _dtype(cfg, ctx.on_gpu)
    tokenizer = ByteTokenizer()
    vocab = padded_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by)
    model = build_model(cfg, vocab, ctx.on_gpu, dtype)
    opt = build_optimizer(model, cfg, ctx.on_gpu, dtype, ctx.dp_cp_group)

    t = cfg.train
    run_dir = cfg.run_dir
    start = 0
    latest = ckpt.latest_iteration(cfg.checkpoint_dir) if cfg.checkpoint.resume else None
    if latest is not None:
        state = ckpt.load_checkpoint(cfg.checkpoint_dir, latest)
        opt.load_state_dict(state)
        start = latest
        if is_logger:
            logger.info("resumed from %s at iteration %d", cfg.checkpoint_dir, latest)
            if latest >= t.train_iters:
                logger.info(
                    "the run is already complete (train.train_iters=%d); raise train.train_iters, "
                    "or set checkpoint.resume=false to train from scratch",
                    t.train_iters,
                )
    dataset = build_train_dataset(cfg, tokenizer, num_samples=t.train_iters * t.global_batch_size)

    if is_logger:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        logger.info(
            "GPT: %d layers, hidden %d, %d heads (%s kv groups), seq %d, %.2fM parameters; "
            "%d ranks = CP %d x DP %d, cp_comm_type=%s, %s, %s",
            cfg.model.num_layers,
            cfg.model.hidden_size,
            cfg.model.num_attention_heads,
            cfg.model.num_query_groups or cfg.model.num_attention_heads,
            cfg.model.seq_length,
            count_parameters(model) / 1e6,
            ctx.world_size,
            ctx.cp_size,
            ctx.dp_size,
            cfg.parallel.cp_comm_type,
            "GPU" if ctx.on_gpu else "CPU",
            str(dtype).replace("torch.", ""),
        )
    metrics = MetricsWriter(run_dir / "metrics.jsonl" if is_logger else None, append=start > 0)
    progress = Progress(cfg.logging.progress_interval_s if is_logger else 0, t.train_iters)
    num_micro = t.global_batch_size // (t.micro_batch_size * ctx.dp_size)
    tokens_per_iter = t.global_batch_size * cfg.model.seq_length
    flops = flops_per_iteration(cfg, vocab, tokens_per_iter)
    result = TrainResult(start_iteration=start, final_iteration=start)
    progress.start(start)
    model.train()
    try:
        for iteration in range(start, t.train_iters):
            began = time.perf_counter()
            opt.zero_grad()
            batches = [
                _local_batch(
                    get_microbatch(dataset, iteration, j, cfg, ctx.dp_rank, ctx.dp_size), ctx
                )
                for j in range(num_micro)
            ]
            # Normalise by the global number of loss tokens, so summing gradients over data x
            # context parallel ranks gives exactly the gradient of the global mean loss.
            counts = torch.stack([b["loss_mask"].sum() for b in batches]).sum().float()
            dist.all_reduce(counts, group=ctx.dp_cp_group)
            loss_sum = torch.zeros((), dtype=torch.float32, device=ctx.device)
            for batch in batches:
                per_token = opt.model(
                    batch["tokens"], batch["position_ids"], None, labels=batch["labels"]
                )
                local = (per_token.float() * batch["loss_mask"]).sum()
                (local / counts).backward()
                loss_sum += local.detach()
            opt.finish_grad_sync()
            if grad_hook is not None:
                grad_hook(iteration, model)
            lr = learning_rate(t, iteration)
            grad_norm = opt.step(lr)
            dist.all_reduce(loss_sum, group=ctx.dp_cp_group)
            loss = float(loss_sum / counts)
            elapsed = time.perf_counter() - began
            record = {
                "iteration": iteration + 1,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "iter_ms": elapsed * 1e3,
                "tokens_per_s": tokens_per_iter / elapsed,
                "tflops_per_rank": flops / elapsed / ctx.world_size / 1e12,
                "peak_mem_mb": peak_memory_mb(ctx.on_gpu),
            }
            result.records.append(record)
            result.final_iteration = iteration + 1
            progress.iteration = iteration + 1
            metrics.write(record)
            done = iteration + 1
            if is_logger and (done % cfg.logging.log_interval == 0 or done == t.train_iters):
                print(format_line(record, t.train_iters), flush=True)
            if not torch.isfinite(torch.tensor(loss)):
                raise FloatingPointError(
                    f"loss is {loss} at iteration {done}; lower train.lr or check the data."
                )
            exiting = t.exit_interval is not None and done % t.exit_interval == 0
            periodic = cfg.checkpoint.save_interval and done % cfg.checkpoint.save_interval == 0
            if cfg.checkpoint.save and (periodic or exiting or done == t.train_iters):
                ckpt.save_checkpoint(cfg.checkpoint_dir, done, opt.state_dict(), {})
                if is_logger:
                    logger.info("saved checkpoint at iteration %d to %s", done, cfg.checkpoint_dir)
            if exiting and done < t.train_iters:
                if is_logger:
                    logger.info("exit_interval reached at iteration %d; stopping", done)
                break
    finally:
        progress.stop()
        metrics.close()
    return result
