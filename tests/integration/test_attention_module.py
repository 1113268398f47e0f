"""``CharmDotProductAttention`` against an fp64 reference, and its refusals of what it lacks."""

from __future__ import annotations

import pytest
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from megatron_charm.megatron import CharmDotProductAttention

WORKLOADS = "tests.integration.integration_workloads"
MODULE_VS_REFERENCE = f"{WORKLOADS}:module_vs_reference"
FORWARD_ERRORS = f"{WORKLOADS}:forward_errors"
DOCUMENTS_VS_REFERENCE = f"{WORKLOADS}:module_documents_vs_reference"


def _config(**kwargs):
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0)
    base.update(kwargs)
    return TransformerConfig(**base)


def _build(config, **kwargs):
    args = dict(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type=None,
        softmax_scale=None,
        pg_collection=None,
    )
    args.update(kwargs)
    return CharmDotProductAttention(**args)


@pytest.mark.gloo
@pytest.mark.parametrize(
    "method,causal,heads,groups,ranks_per_node",
    [
        ("charm", True, 4, 4, None),
        ("charm", True, 4, 2, 2),
        ("charm", False, 4, 1, 2),
        ("rm+", True, 4, 2, None),
        ("merge", False, 4, 4, None),
        ("ring", True, 4, 2, None),
    ],
)
def test_module_matches_fp64_reference_cp4(pool4, method, causal, heads, groups, ranks_per_node):
    errors = pool4.run(MODULE_VS_REFERENCE, method, causal, heads, groups, ranks_per_node)
    assert max(errors) < 1e-5, errors


@pytest.mark.gloo
@pytest.mark.parametrize("causal", [True, False])
def test_module_cp1(pool1, causal):
    """CP size 1 must work too: a config that says charm trains on one rank."""
    (error,) = pool1.run(MODULE_VS_REFERENCE, "charm", causal, 2, 1, None)
    assert error < 1e-5


@pytest.mark.gloo
def test_module_explicit_softmax_scale(pool4):
    errors = pool4.run(MODULE_VS_REFERENCE, "charm", True, 4, 2, 2, softmax_scale=0.2)
    assert max(errors) < 1e-5, errors


@pytest.mark.gloo
def test_forward_refuses_packed_bias_and_padding(pool1):
    method, packed, bias, padding, arbitrary = pool1.run(FORWARD_ERRORS)[0]
    assert method == "charm"  # CP = 1: megatron passes no cp_comm_type; the default applies
    assert "qkv_format='sbhd'" in packed and "'thd'" in packed
    assert "attention_bias" in bias
    assert "padding" in padding and "causal" in padding
    assert "not a causal document mask" in arbitrary


@pytest.mark.gloo
@pytest.mark.parametrize(
    "kind,window",
    [("thd", None), ("reset", None), ("thd", (5, 0)), ("reset", (9, 0))],
    ids=["thd", "reset-attention-mask", "thd-window", "reset-window"],
)
def test_module_documents_match_reference(pool4, kind, window):
    """THD packed_seq_params (with padding) and --reset-attention-mask masks (different
    documents per sample), with and without megatron-core's window_size, on a 2 x 2 split."""
    errors = pool4.run(DOCUMENTS_VS_REFERENCE, kind, window)
    assert max(errors) < 1e-5, errors


@pytest.mark.parametrize(
    "config_kwargs,build_kwargs,fragment",
    [
        ({"attention_dropout": 0.1}, {}, "--attention-dropout 0"),
        ({}, {"attention_dropout": 0.1}, "attention_dropout=0.1"),
        ({}, {"cp_comm_type": "p2p"}, "cp_comm_type='p2p'"),
        ({}, {"method": "zigzag"}, "cp_comm_type='zigzag'"),
        ({"context_parallel_size": 2, "cp_comm_type": ["charm"]}, {}, "per-layer list"),
        ({}, {"attention_type": "cross"}, "self-attention only"),
        ({}, {"attn_mask_type": AttnMaskType.arbitrary}, "AttnMaskType.causal"),
        ({"window_size": (8, -2)}, {}, "--window-size"),
        ({}, {"k_channels": 8, "v_channels": 4}, "head dimension"),
    ],
)
def test_constructor_refuses_unsupported_options(config_kwargs, build_kwargs, fragment):
    with pytest.raises(ValueError) as info:
        _build(_config(**config_kwargs), **build_kwargs)
    assert fragment in str(info.value)
