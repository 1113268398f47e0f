"""Rank-pool task: state dicts move between TE-spec, local-spec and CHARM+ GPT models."""

from __future__ import annotations

import pickle
from typing import Any

import torch

LAYERS = 2
ATTENTION_EXTRA = "core_attention._extra_state"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a is None and b is None


def _gpt(spec: Any, seed: int) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type="learned_absolute",
    )


def _fp8_meta_tensor() -> torch.Tensor:
    """A stand-in for the FP8 metadata TE pickles into ``_extra_state`` after an FP8 run."""
    state = {"extra_fp8_variables": {"num_gemms": 3}, "scale_fwd": torch.ones(3)}
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def round_trips() -> dict[str, Any]:
    """Load a simulated TE state dict into CHARM+ and save it back; local spec both ways."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_charm.megatron import clear_topology_cache, get_gpt_layer_charm_spec

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    clear_topology_cache()
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    charm_spec = get_gpt_layer_charm_spec()
    source = _gpt(charm_spec, seed=1)
    # megatron-core's linear layers save an ``_extra_state`` of None; only attention's is ours.
    extra_keys = sorted(k for k in source.state_dict() if k.endswith(ATTENTION_EXTRA))
    weights = {k: v for k, v in source.state_dict().items() if k not in extra_keys}

    # A TE-spec checkpoint: the same weights, plus TE's core_attention._extra_state per layer.
    te_state = {**weights, **{k: _fp8_meta_tensor() for k in extra_keys}}
    charm = _gpt(charm_spec, seed=2)
    te_into_charm = charm.load_state_dict(te_state, strict=True)
    saved = charm.state_dict()
    back_to_te = all(torch.equal(saved[k], te_state[k]) for k in extra_keys)
    same_weights = all(_same(saved[k], v) for k, v in weights.items())

    # TE >= 2.4 saves an empty tensor when it ran without FP8; CHARM+ then saves "no state".
    empty = {**weights, **{k: torch.empty(0, dtype=torch.uint8) for k in extra_keys}}
    charm.load_state_dict(empty, strict=True)
    no_state = [pickle.loads(charm.state_dict()[k].numpy().tobytes()) for k in extra_keys]

    # The local spec (megatron-core's DotProductAttention) has no extra state: both ways.
    local = _gpt(get_gpt_layer_local_spec(), seed=3)
    local_into_charm = charm.load_state_dict(local.state_dict(), strict=True)
    # The other way, our extra-state entries are the only keys the local spec does not know.
    charm_into_local = local.load_state_dict(charm.state_dict(), strict=False)
    parallel_state.destroy_model_parallel()
    clear_topology_cache()
    return {
        "extra_keys": extra_keys,
        "te_into_charm": (te_into_charm.missing_keys, te_into_charm.unexpected_keys),
        "back_to_te": back_to_te,
        "same_weights": same_weights,
        "no_state": no_state,
        "local_into_charm": (local_into_charm.missing_keys, local_into_charm.unexpected_keys),
        "charm_into_local": (charm_into_local.missing_keys, charm_into_local.unexpected_keys),
    }
