"""CharmDotProductAttention refuses Megatron's CUDA-graph options that would capture it."""

from __future__ import annotations

import pytest
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from megatron_charm.megatron.attention import _check_config, captures_attention


def _config(**kwargs):
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0)
    return TransformerConfig(**base, **kwargs)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"cuda_graph_impl": "local"}, "cuda_graph_impl='local'"),
        ({"enable_cuda_graph": True}, "enable_cuda_graph=True"),
        ({"external_cuda_graph": True}, "external_cuda_graph=True"),
        ({"cuda_graph_impl": "transformer_engine"}, "the whole layer"),
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "attn"}, "attn"),
    ],
)
def test_cuda_graphs_that_capture_attention_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match="CUDA graphs would capture") as info:
        _check_config(_config(**kwargs), "self", AttnMaskType.causal, None)
    assert fragment in str(info.value) and "--cuda-graph-impl none" in str(info.value)


def test_graphs_that_leave_attention_out_are_allowed():
    assert captures_attention(_config()) is None
    cfg = _config(cuda_graph_impl="transformer_engine", cuda_graph_scope="mlp")
    assert captures_attention(cfg) is None
    _check_config(cfg, "self", AttnMaskType.causal, None)


def test_module_constructor_refuses_cuda_graphs():
    from megatron_charm.megatron import CharmDotProductAttention

    with pytest.raises(ValueError, match="CUDA graphs would capture"):
        CharmDotProductAttention(
            _config(cuda_graph_impl="local"), 1, AttnMaskType.causal, "self", pg_collection=None
        )
