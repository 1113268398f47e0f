"""Every rule a training config must satisfy, in one place.

:func:`validate_config` runs when a config is loaded (rules on single values) and again in the
command before any rank starts, with the world size the job will have (rules that involve the
number of ranks). A bad value therefore fails once, in the launching process, with a message
that names the key, the rule and what to change.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron_charm.auto import AUTO
from megatron_charm.nodes import NODE_SPLITS
from megatron_charm.plan.options import BASELINES, MEGATRON_METHODS, SEQ_LAYOUT_OF

if TYPE_CHECKING:
    from megatron_charm.train.config import Config

#: cp_comm_type values served by Transformer Engine (GPU baselines) in the trainer.
TE_COMM_TYPES = ("p2p", "a2a", "all_gather")
#: cp_comm_type values served by megatron-charm's own attention (as in Megatron-LM).
CHARM_COMM_TYPES = (*MEGATRON_METHODS, AUTO)


def _positive(name: str, value: int | float | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value} must be a positive number; set {name} to a value > 0.")


def _non_negative(name: str, value: int | float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value} must be >= 0; set {name} to 0 or more.")


def _check_sizes(cfg: Config) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for name, value in (
        ("parallel.context_parallel_size", p.context_parallel_size),
        ("parallel.nproc", p.nproc),
        ("parallel.timeout_s", p.timeout_s),
        ("model.num_layers", m.num_layers),
        ("model.hidden_size", m.hidden_size),
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.seq_length", m.seq_length),
        ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
        ("model.init_method_std", m.init_method_std),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.global_batch_size", t.global_batch_size),
        ("train.train_iters", t.train_iters),
        ("train.lr", t.lr),
        ("logging.log_interval", cfg.logging.log_interval),
    ):
        _positive(name, value)
    for name, value in (
        ("parallel.ranks_per_node", p.ranks_per_node),
        ("model.num_query_groups", m.num_query_groups),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
        ("train.lr_decay_iters", t.lr_decay_iters),
        ("train.exit_interval", t.exit_interval),
    ):
        _positive(name, value, optional=True)
    for name, value in (
        ("model.attention_dropout", m.attention_dropout),
        ("model.hidden_dropout", m.hidden_dropout),
        ("train.min_lr", t.min_lr),
        ("train.lr_warmup_iters", t.lr_warmup_iters),
        ("train.weight_decay", t.weight_decay),
        ("train.clip_grad", t.clip_grad),
        ("logging.progress_interval_s", cfg.logging.progress_interval_s),
        ("checkpoint.save_interval", cfg.checkpoint.save_interval),
    ):
        _non_negative(name, value)
    for name in ("attention_dropout", "hidden_dropout"):
        if getattr(m, name) >= 1:
            raise ValueError(f"model.{name}={getattr(m, name)} must be below 1.")
    if t.min_lr > t.lr:
        raise ValueError(
            f"train.min_lr={t.min_lr} exceeds train.lr={t.lr}; lower train.min_lr or raise "
            "train.lr."
        )


def _check_choices(cfg: Config) -> None:
    p, m, t, d = cfg.parallel, cfg.model, cfg.train, cfg.data
    if p.cp_comm_type in SEQ_LAYOUT_OF:
        raise ValueError(
            f"parallel.cp_comm_type={p.cp_comm_type!r} expects {SEQ_LAYOUT_OF[p.cp_comm_type]} "
            "sequence shards, but Megatron shards the sequence zigzag; set "
            "parallel.cp_comm_type=ring for the ring on Megatron's layout."
        )
    if p.cp_comm_type in BASELINES:
        raise ValueError(
            f"parallel.cp_comm_type={p.cp_comm_type!r} is a baseline for cp_attention, the "
            "benchmark and the simulator (the paper's TASP), not a method to train with; choose "
            f"one of {', '.join(CHARM_COMM_TYPES)}."
        )
    if p.cp_comm_type not in CHARM_COMM_TYPES + TE_COMM_TYPES:
        raise ValueError(
            f"parallel.cp_comm_type={p.cp_comm_type!r}: choose one of "
            f"{', '.join(CHARM_COMM_TYPES)} (or, on GPU with Transformer Engine, "
            f"{', '.join(TE_COMM_TYPES)})."
        )
    if (p.cp_comm_type == AUTO) != (p.profile is not None):
        raise ValueError(
            f"parallel.cp_comm_type={p.cp_comm_type!r} with parallel.profile={p.profile!r}: auto "
            "needs a profile (write one with `megatron-charm-sim calibrate`, or set H100/H20/L20) "
            "and the other methods take none; set both or neither"
        )
    if p.profile is not None:
        from megatron_charm.sim.profile import load_profile

        load_profile(p.profile)
    if p.kernel is not None:
        from megatron_charm.kernels.backends import check_kernel_name  # imports torch

        check_kernel_name(p.kernel, "parallel.kernel", "null for the default by device and dtype.")
        if p.cp_comm_type not in CHARM_COMM_TYPES:
            raise ValueError(
                f"parallel.kernel={p.kernel!r} picks the block kernel of the CHARM+ methods, but "
                f"parallel.cp_comm_type={p.cp_comm_type!r} runs in Transformer Engine; set "
                "parallel.kernel=null."
            )
    if p.cp_comm_type in CHARM_COMM_TYPES and m.attention_dropout != 0:
        raise ValueError(
            f"model.attention_dropout={m.attention_dropout}: CHARM+ methods do not implement "
            "attention dropout; set model.attention_dropout=0."
        )
    if m.transformer_impl not in ("local", "transformer_engine"):
        raise ValueError(
            f"model.transformer_impl={m.transformer_impl!r}: use local or transformer_engine."
        )
    if d.kind not in ("indexed", "mock"):
        raise ValueError(f"data.kind={d.kind!r}: use indexed or mock.")
    if d.tokenizer != "byte":
        raise ValueError(f"data.tokenizer={d.tokenizer!r}: only the byte tokenizer is built in.")
    if t.precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"train.precision={t.precision!r}: use auto, fp32 or bf16.")


def _check_shapes(cfg: Config) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    cp = p.context_parallel_size
    if m.seq_length % (2 * cp) != 0:
        raise ValueError(
            f"model.seq_length={m.seq_length} must be divisible by 2 x context_parallel_size = "
            f"{2 * cp} (the causal zigzag split). Change model.seq_length."
        )
    if m.hidden_size % m.num_attention_heads != 0:
        raise ValueError(
            f"model.hidden_size={m.hidden_size} must be divisible by model.num_attention_heads="
            f"{m.num_attention_heads}."
        )
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups != 0:
        raise ValueError(
            f"model.num_attention_heads={m.num_attention_heads} must be divisible by "
            f"model.num_query_groups={groups}."
        )
    if t.global_batch_size % t.micro_batch_size != 0:
        raise ValueError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={t.micro_batch_size}."
        )


def _check_node_split(cfg: Config) -> None:
    p = cfg.parallel
    cp = p.context_parallel_size
    if p.node_split not in NODE_SPLITS:
        raise ValueError(
            f"parallel.node_split={p.node_split!r} is not one of {', '.join(NODE_SPLITS)}; set "
            "parallel.node_split=host (host names) or numa (NUMA domains of GPUs without NVLink)."
        )
    if p.ranks_per_node is not None and cp % p.ranks_per_node != 0:
        raise ValueError(
            f"parallel.ranks_per_node={p.ranks_per_node} does not divide "
            f"parallel.context_parallel_size={cp}: every node must hold the same number of CP "
            f"ranks. Set parallel.ranks_per_node to a divisor of {cp}."
        )
    sizes = p.hierarchical_context_parallel_sizes
    if sizes:
        if min(sizes) < 1 or math.prod(sizes) != cp:
            raise ValueError(
                f"parallel.hierarchical_context_parallel_sizes={sizes}: the sizes must be "
                f"positive and multiply to parallel.context_parallel_size={cp} (e.g. "
                f"[ranks_per_node, num_nodes]). Change one of the two."
            )
        if len(sizes) != 2 and p.ranks_per_node is None and p.cp_comm_type in CHARM_COMM_TYPES:
            raise ValueError(
                f"parallel.hierarchical_context_parallel_sizes={sizes}: CHARM+ reads two levels, "
                "[ranks_per_node, num_nodes]; give two sizes, or set parallel.ranks_per_node."
            )
    rpn = p.ranks_per_node or (sizes[0] if sizes and len(sizes) == 2 else None)
    if cfg.plan.combine_nodes:
        if p.cp_comm_type != "charm":
            raise ValueError(
                f"plan.combine_nodes=true is a charm option, but parallel.cp_comm_type="
                f"{p.cp_comm_type!r}; set plan.combine_nodes=false."
            )
        if rpn is not None and cp // rpn < 2:
            raise ValueError(
                f"plan.combine_nodes=true needs at least two nodes, but "
                f"parallel.context_parallel_size={cp} with {rpn} ranks per node makes "
                f"{cp // rpn}; set plan.combine_nodes=false."
            )


def _check_world(cfg: Config, world_size: int) -> None:
    p, t = cfg.parallel, cfg.train
    cp = p.context_parallel_size
    if world_size % cp != 0:
        raise ValueError(
            f"parallel.context_parallel_size={cp} does not divide the number of ranks "
            f"{world_size}. Start a multiple of {cp} ranks (parallel.nproc, torchrun "
            "--nproc-per-node, or Slurm tasks), or change parallel.context_parallel_size."
        )
    dp = world_size // cp
    if t.global_batch_size % (t.micro_batch_size * dp) != 0:
        raise ValueError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp} "
            f"({world_size} ranks / CP {cp}). Change train.global_batch_size."
        )


def validate_config(cfg: Config, world_size: int | None = None) -> None:
    """Check ``cfg``; with ``world_size``, also the rules that involve the number of ranks.

    Raises:
        ValueError: naming the key, the rule it breaks and the setting to change.
    """
    _check_sizes(cfg)
    _check_choices(cfg)
    _check_shapes(cfg)
    _check_node_split(cfg)
    if world_size is not None:
        _check_world(cfg, world_size)
