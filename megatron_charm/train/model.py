"""Build megatron-core's ``GPTModel`` with the attention backend the config asks for."""

from __future__ import annotations

from typing import Any

import torch

from megatron_charm.auto import AUTO
from megatron_charm.train.config import CHARM_COMM_TYPES, Config


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build_transformer_config(cfg: Config, on_gpu: bool, dtype: torch.dtype) -> Any:
    """megatron-core ``TransformerConfig`` for the model section (no CUDA assumptions on CPU)."""
    from megatron.core.transformer import TransformerConfig

    m, p = cfg.model, cfg.parallel
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        attention_dropout=m.attention_dropout,
        hidden_dropout=m.hidden_dropout,
        init_method_std=m.init_method_std,
        context_parallel_size=p.context_parallel_size,
        cp_comm_type=p.cp_comm_type,
        hierarchical_context_parallel_sizes=p.hierarchical_context_parallel_sizes,
        # CPU initialisation draws weights from torch's default generator, so the same seed gives
        # the same weights on every rank and at every CP size (the CP = 1 vs CP = 4 tests).
        use_cpu_initialization=not on_gpu,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        # The local spec's fused kernels (persist layer norm, bias-gelu) are CUDA-only.
        persist_layer_norm=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )


def build_layer_spec(cfg: Config) -> Any:
    """The GPT layer spec: CHARM+ core attention, or stock Transformer Engine for TE baselines."""
    from megatron_charm.megatron import get_gpt_layer_charm_spec

    use_te = cfg.model.transformer_impl == "transformer_engine"
    if cfg.parallel.cp_comm_type in CHARM_COMM_TYPES:
        return get_gpt_layer_charm_spec(
            use_transformer_engine=use_te,
            method=cfg.parallel.cp_comm_type,
            ranks_per_node=cfg.parallel.ranks_per_node,
            node_split=cfg.parallel.node_split,
            options=cfg.plan
            if cfg.parallel.cp_comm_type == AUTO
            else cfg.plan.replace(method=cfg.parallel.cp_comm_type),
            timeout_s=cfg.parallel.timeout_s,
            profile=cfg.parallel.profile,
            # None: the module reads MEGATRON_CHARM_KERNEL once, as it does under Megatron-LM
            kernel=cfg.parallel.kernel,
        )
    # TE baselines: p2p / a2a / all_gather run inside TEDotProductAttention.
    if not (torch.cuda.is_available() and transformer_engine_available()):
        raise ValueError(
            f"parallel.cp_comm_type={cfg.parallel.cp_comm_type!r} is a Transformer Engine "
            "baseline and needs a GPU with transformer-engine installed "
            "(pip install 'megatron-charm[gpu]'). On CPU use charm, rm+, merge or ring."
        )
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return get_gpt_layer_with_transformer_engine_spec()


def build_model(cfg: Config, vocab_size: int, on_gpu: bool, dtype: torch.dtype) -> Any:
    """``GPTModel`` with learned absolute positions (RoPE is CUDA-only in megatron-core)."""
    from megatron.core.models.gpt import GPTModel

    if cfg.model.transformer_impl == "transformer_engine" and not on_gpu:
        raise ValueError(
            "model.transformer_impl=transformer_engine needs a GPU; use model.transformer_impl="
            "local on CPU."
        )
    torch.manual_seed(cfg.run.seed)
    if on_gpu:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(cfg.run.seed)
    config = build_transformer_config(cfg, on_gpu, dtype)
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(cfg),
        vocab_size=vocab_size,
        max_sequence_length=cfg.model.seq_length,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True,
    )
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
