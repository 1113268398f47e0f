"""Megatron-core integration: the CHARM+ core_attention module, its process groups and specs.

Typical use::

    from megatron_charm.megatron import get_gpt_layer_charm_spec
    spec = get_gpt_layer_charm_spec()                # local spec; CPU and GPU
    model = GPTModel(config=cfg, transformer_layer_spec=spec, ...)
    # cfg.cp_comm_type = "charm" (or rm+, merge, ring); CP size from parallel_state.
"""

from megatron_charm.megatron.attention import CHARM_METHODS, CharmDotProductAttention
from megatron_charm.megatron.compat import (
    MegatronCompatibilityError,
    check_megatron_compat,
    core_attention_contract_problems,
)
from megatron_charm.megatron.groups import (
    ENV_RANKS_PER_NODE,
    build_charm_groups,
    cached_topologies,
    clear_topology_cache,
    get_charm_topology,
    get_cp_group,
    resolve_node_split,
)
from megatron_charm.megatron.spec import (
    apply_charm,
    charm_core_attention_spec,
    get_gpt_decoder_block_charm_spec,
    get_gpt_layer_charm_spec,
)

__all__ = [
    "CHARM_METHODS",
    "CharmDotProductAttention",
    "MegatronCompatibilityError",
    "check_megatron_compat",
    "core_attention_contract_problems",
    "ENV_RANKS_PER_NODE",
    "build_charm_groups",
    "cached_topologies",
    "clear_topology_cache",
    "get_charm_topology",
    "get_cp_group",
    "resolve_node_split",
    "apply_charm",
    "charm_core_attention_spec",
    "get_gpt_decoder_block_charm_spec",
    "get_gpt_layer_charm_spec",
]
