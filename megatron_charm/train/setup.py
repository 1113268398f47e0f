"""Setting up a training run: validation, the job, model and optimizer, resume, the run directory.

:func:`setup` returns a :class:`Trainer` that :mod:`megatron_charm.train.loop` steps through.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_charm.train import checkpoint as ckpt
from megatron_charm.train.config import Config, TrainConfig, dump_config
from megatron_charm.train.data import build_train_dataset
from megatron_charm.train.launch import DistContext, setup_distributed
from megatron_charm.train.metrics import MetricsWriter, Progress, flops_per_iteration
from megatron_charm.train.model import build_model, count_parameters
from megatron_charm.train.optim import MegatronOptimizer, TorchOptimizer, build_optimizer
from megatron_charm.train.rundir import METRICS_FILE, check_run_dir, clear_previous
from megatron_charm.train.schedule import schedule_on_resume
from megatron_charm.train.tokenizer import ByteTokenizer, padded_vocab_size
from megatron_charm.train.validate import validate_config

logger = logging.getLogger("megatron_charm")


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


@dataclass
class Trainer:
    """Everything one invocation of :func:`train` works with, built once by :func:`setup`."""

    cfg: Config
    ctx: DistContext
    model: torch.nn.Module
    opt: TorchOptimizer | MegatronOptimizer
    dataset: Any
    schedule: TrainConfig
    """The learning-rate schedule in force: ``cfg.train``, or the one a resumed checkpoint saved."""
    start: int
    """Iteration this invocation starts from (0, or the checkpoint it resumed)."""
    num_micro: int
    """Micro-batches per optimizer step on each data-parallel rank."""
    tokens_per_iter: int
    """Tokens of one global batch."""
    flops_per_iter: float
    """Model FLOPs of one optimizer step (for the TFLOPS column)."""
    dtype: torch.dtype
    """Parameter and compute dtype."""
    metrics: MetricsWriter = field(default_factory=lambda: MetricsWriter(None))
    progress: Progress = field(default_factory=lambda: Progress(0, 0))

    @property
    def is_logger(self) -> bool:
        return self.ctx.global_rank == 0


def _env_world_size() -> int | None:
    """The job's size when a launcher has already set it (``None`` for a lone process)."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def setup(cfg: Config) -> Trainer:
    """Validate, join the job, build model and optimizer, resume if asked, open the logs."""
    validate_config(cfg, _env_world_size())
    # Every rank decides, so that a refusal stops all of them instead of leaving some waiting.
    resume_at = check_run_dir(cfg)
    ctx = setup_distributed(cfg)
    dtype = _dtype(cfg, ctx.on_gpu)
    tokenizer = ByteTokenizer()
    vocab = padded_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by)
    model = build_model(cfg, vocab, ctx.on_gpu, dtype)
    opt = build_optimizer(model, cfg, ctx.on_gpu, dtype, ctx.dp_cp_group)
    schedule = _resume(cfg, ctx, opt, resume_at)
    t = cfg.train
    dataset = build_train_dataset(cfg, tokenizer, num_samples=t.train_iters * t.global_batch_size)
    tokens_per_iter = t.global_batch_size * cfg.model.seq_length
    trainer = Trainer(
        cfg=cfg,
        ctx=ctx,
        model=model,
        opt=opt,
        dataset=dataset,
        schedule=schedule,
        start=resume_at or 0,
        num_micro=t.global_batch_size // (t.micro_batch_size * ctx.dp_size),
        tokens_per_iter=tokens_per_iter,
        flops_per_iter=flops_per_iteration(cfg, vocab, tokens_per_iter),
        dtype=dtype,
    )
    _open_run_dir(trainer, resume_at)
    return trainer


def _resume(
    cfg: Config, ctx: DistContext, opt: TorchOptimizer | MegatronOptimizer, at: int | None
) -> TrainConfig:
    """Load checkpoint ``at`` into ``opt`` (if any); returns the schedule to follow."""
    is_logger = ctx.global_rank == 0
    if at is None:
        return cfg.train
    state, meta = _load_on_every_rank(cfg, ctx, at)
    opt.load_state_dict(state)
    if is_logger:
        logger.info("resumed from %s at iteration %d", cfg.checkpoint_dir, at)
        if at >= cfg.train.train_iters:
            logger.info(
                "the run is already complete (train.train_iters=%d); raise train.train_iters, "
                "or start over with --overwrite",
                cfg.train.train_iters,
            )
    saved = meta.get("schedule", {})
    schedule = schedule_on_resume(cfg.train, saved)
    if is_logger and schedule.lr_decay_iters != cfg.train.lr_decay_iters:
        logger.warning(
            "resuming with train.train_iters=%d, but the checkpoint's learning-rate schedule "
            "decays over %d iterations; keeping it (the rate stays at train.min_lr=%g after "
            "iteration %d). Set train.lr_decay_iters=%d to stretch the schedule instead.",
            cfg.train.train_iters,
            schedule.lr_decay_iters,
            cfg.train.min_lr,
            schedule.lr_decay_iters,
            cfg.train.train_iters,
        )
    return schedule


def _load_on_every_rank(cfg: Config, ctx: DistContext, at: int) -> tuple[dict, dict]:
    """Load checkpoint ``at``; if any rank cannot (its own RNG file may be damaged), all raise.

    Without the agreement the ranks that loaded would wait in their first collective for the
    one that failed, until the timeout.
    """
    error: ValueError | None = None
    try:
        state, meta = ckpt.load_checkpoint(cfg.checkpoint_dir, at)
    except ValueError as exc:
        error = exc
    failed = torch.tensor([0.0 if error is None else 1.0], device=ctx.device)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if failed.item() > 0:
        raise ValueError(
            f"{int(failed.item())} rank(s) could not load checkpoint iteration {at} from "
            f"{cfg.checkpoint_dir}; their error messages name the file and the way out."
        )
    return state, meta


def _open_run_dir(trainer: Trainer, resume_at: int | None) -> None:
    """Rank 0 writes the resolved config and opens the metrics file; every rank a progress."""
    cfg, ctx = trainer.cfg, trainer.ctx
    run_dir = cfg.run_dir
    if trainer.is_logger:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_at is None and cfg.run.overwrite:
            clear_previous(cfg)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        logger.info(
            "GPT: %d layers, hidden %d, %d heads (%s kv groups), seq %d, %.2fM parameters; "
            "%d ranks = CP %d x DP %d, cp_comm_type=%s, %s, %s",
            cfg.model.num_layers,
            cfg.model.hidden_size,
            cfg.model.num_attention_heads,
            cfg.model.num_query_groups or cfg.model.num_attention_heads,
            cfg.model.seq_length,
            count_parameters(trainer.model) / 1e6,
            ctx.world_size,
            ctx.cp_size,
            ctx.dp_size,
            cfg.parallel.cp_comm_type,
            "GPU" if ctx.on_gpu else "CPU",
            str(trainer.dtype).replace("torch.", ""),
        )
    trainer.metrics = MetricsWriter(
        run_dir / METRICS_FILE if trainer.is_logger else None, resumed_at=resume_at
    )
    trainer.progress = Progress(
        cfg.logging.progress_interval_s if trainer.is_logger else 0, cfg.train.train_iters
    )
