"""Spec helpers put CHARM+ into megatron-core specs; the compatibility check fails loudly."""

from __future__ import annotations

import importlib.metadata

import pytest
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import attention as mc_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_charm.megatron import (
    CharmDotProductAttention,
    MegatronCompatibilityError,
    apply_charm,
    check_megatron_compat,
    core_attention_contract_problems,
    get_gpt_layer_charm_spec,
)
from megatron_charm.megatron.compat import FORWARD_PROTOCOL_NAMES


def _core(spec):
    return spec.submodules.self_attention.submodules.core_attention


def test_local_layer_spec_gets_charm_attention():
    spec = get_gpt_layer_charm_spec(method="ring", ranks_per_node=2)
    core = _core(spec)
    assert core.module is CharmDotProductAttention
    assert core.params == {"method": "ring", "ranks_per_node": 2}
    # Everything else is megatron-core's own local spec.
    stock = gpt_layer_specs.get_gpt_layer_local_spec()
    # repr, not ==: megatron-core 0.19 builds the MLP entry as a functools.partial, which
    # compares by identity, and apply_charm hands back a copy of the spec.
    assert repr(spec.submodules.mlp) == repr(stock.submodules.mlp)
    assert spec.submodules.self_attention.submodules.linear_qkv == (
        stock.submodules.self_attention.submodules.linear_qkv
    )


def test_apply_charm_copies_and_handles_lists_and_blocks():
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    stock = gpt_layer_specs.get_gpt_layer_local_spec()
    swapped = apply_charm(stock)
    assert _core(stock) is DotProductAttention  # the input spec is left alone
    assert _core(swapped).module is CharmDotProductAttention
    layers = apply_charm([stock, stock])
    assert all(_core(layer).module is CharmDotProductAttention for layer in layers)
    block = apply_charm(TransformerBlockSubmodules(layer_specs=[stock, stock]))
    assert all(_core(layer).module is CharmDotProductAttention for layer in block.layer_specs)


def test_decoder_block_spec_helper():
    from megatron.core.transformer import TransformerConfig

    from megatron_charm.megatron import get_gpt_decoder_block_charm_spec

    config = TransformerConfig(num_layers=3, hidden_size=16, num_attention_heads=2)
    block = get_gpt_decoder_block_charm_spec(config, use_transformer_engine=False, pp_rank=0)
    assert len(block.layer_specs) == 3
    assert all(_core(layer).module is CharmDotProductAttention for layer in block.layer_specs)


def test_transformer_engine_layer_spec_gets_charm_attention():
    pytest.importorskip("transformer_engine")
    spec = get_gpt_layer_charm_spec(use_transformer_engine=True)
    assert _core(spec).module is CharmDotProductAttention


def test_spec_helpers_refuse_bad_input():
    with pytest.raises(ValueError, match="no self_attention"):
        apply_charm(object())
    with pytest.raises(ValueError, match="not a CHARM\\+ method"):
        get_gpt_layer_charm_spec(method="p2p")
    with pytest.raises(ValueError, match="MLA"):
        get_gpt_layer_charm_spec(multi_latent_attention=True)


def test_installed_megatron_core_matches_our_contract():
    assert core_attention_contract_problems() == []
    # on success it names the installed version, as the distribution's metadata records it
    # (megatron-core 0.19's package_info appends "+<git sha>" of the working directory's checkout)
    version = check_megatron_compat()
    assert version.split("+")[0] == importlib.metadata.version("megatron-core"), version


def test_compat_check_fails_loudly_on_a_changed_signature(monkeypatch):
    class ChangedBuilder:
        def __call__(
            self,
            *,
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            cp_comm_type,
            softmax_scale,
            pg_collection,
            new_required_thing,
        ): ...

    class ChangedForward:
        def forward(
            self, query, key, value, /, *, attn_mask_type, attention_bias, packed_seq_params
        ): ...

    monkeypatch.setattr(mc_attention, "CoreAttentionBuilder", ChangedBuilder)
    # 0.16.x names the forward protocol CoreAttention, 0.19.x CoreAttentionInterface.
    (name,) = [n for n in FORWARD_PROTOCOL_NAMES if hasattr(mc_attention, n)]
    monkeypatch.setattr(mc_attention, name, ChangedForward)
    check_megatron_compat.cache_clear()
    try:
        with pytest.raises(MegatronCompatibilityError) as info:
            check_megatron_compat()
    finally:
        check_megatron_compat.cache_clear()
    message = str(info.value)
    assert "new_required_thing" in message
    assert "attention_mask" in message
    assert "megatron-core==0.16.1" in message and "megatron-core>=0.19" in message
