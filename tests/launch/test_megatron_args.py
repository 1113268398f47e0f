"""``megatron_charm.megatron.args``: what patched Megatron-LM ``validate_args`` refuses or passes.

The namespaces carry Megatron-LM ``core_v0.16.1``'s defaults for the flags involved
(``megatron_defaults``; ``test_megatron_lm_checkout.py`` compares them with the real parser when a
checkout is at hand), so each test changes only what a user would type.
"""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from megatron_charm.megatron import args as margs
from megatron_charm.plan import PlanOptions


def _args(**changes) -> argparse.Namespace:
    values = margs.megatron_defaults()
    values.update(
        cp_comm_type=["charm"],
        context_parallel_size=8,
        attention_dropout=0.0,
        charm_model_builder="gpt",
    )
    values.update(changes)
    return argparse.Namespace(**values)


def _refusal(**changes) -> str:
    with pytest.raises(ValueError) as info:
        margs.validate_megatron_args(_args(**changes))
    return str(info.value)


def test_documented_charm_run_passes():
    margs.validate_megatron_args(_args())


def test_auto_needs_a_loadable_profile():
    assert "needs --charm-profile" in _refusal(cp_comm_type=["auto"])
    assert "neither a preset" in _refusal(cp_comm_type=["auto"], charm_profile="missing.json")
    assert "--charm-profile" in _refusal(charm_profile="H100")  # charm takes none
    margs.validate_megatron_args(_args(cp_comm_type=["auto"], charm_profile="H100"))
    assert margs.plan_options_from_args(_args(cp_comm_type=["auto"])).method == "charm"
    with pytest.raises(ValueError, match="only apply to --cp-comm-type"):
        margs.validate_megatron_args(_args(cp_comm_type=["p2p"], charm_profile="H100"))


def test_megatron_default_attention_dropout_is_refused_with_advice():
    message = _refusal(attention_dropout=0.1)
    assert "--attention-dropout 0.1" in message and "pass --attention-dropout 0" in message


@pytest.mark.parametrize(
    "attr,flag",
    [
        ("hybrid_context_parallel", "--hybrid-context-parallel"),
        ("rl_use_sequence_packing", "--rl-use-sequence-packing"),
        ("window_attn_skip_freq", "--window-attn-skip-freq"),
    ],
)
def test_unsupported_packing_is_refused(attr, flag):
    message = _refusal(**{attr: 2 if attr == "window_attn_skip_freq" else True})
    assert flag in message and "remove" in message


@pytest.mark.parametrize(
    "changes",
    [{"reset_attention_mask": True}, {"sft": True}, {"window_size": (128, 0)}],
    ids=["reset-attention-mask", "sft", "window-size"],
)
def test_documents_and_windows_pass(changes):
    """CHARM+ reads documents (THD packed_seq_params, --reset-attention-mask) and windows."""
    margs.validate_megatron_args(_args(**changes))  # raises on a refusal


def test_reset_attention_mask_needs_the_mask_in_the_batch():
    message = _refusal(reset_attention_mask=True, create_attention_mask_in_dataloader=False)
    assert "drop --no-create-attention-mask-in-dataloader" in message


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"multi_latent_attention": True}, "remove --multi-latent-attention"),
        ({"experimental_attention_variant": "gated_delta_net"}, "--experimental-attention"),
        ({"use_legacy_models": True}, "remove --use-legacy-models"),
        ({"softmax_type": "learnable"}, "--softmax-type vanilla"),
        ({"qk_clip": True}, "--qk-clip"),
        ({"log_max_attention_logit": True}, "--log-max-attention-logit"),
    ],
)
def test_attention_variants_are_refused(changes, fragment):
    assert fragment in _refusal(**changes)


@pytest.mark.parametrize("attr", ["fp8_dot_product_attention", "fp8_multi_head_attention"])
def test_fp8_attention_is_refused(attr):
    message = _refusal(**{attr: True})
    assert attr in message and "--fp8-format" in message


def test_deterministic_mode_is_allowed():
    # Merges run in plan order and flash-attn runs its deterministic backward under
    # torch.use_deterministic_algorithms, which --deterministic-mode turns on.
    margs.validate_megatron_args(_args(deterministic_mode=True))


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"cuda_graph_impl": "local"}, "cuda_graph_impl='local'"),
        ({"cuda_graph_impl": "transformer_engine"}, "the whole layer"),
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["attn"]}, "attn"),
        # before validate_args turns the deprecated flag into cuda_graph_impl
        ({"enable_cuda_graph": True}, "enable_cuda_graph=True"),
    ],
)
def test_cuda_graphs_that_capture_attention_are_refused(changes, fragment):
    message = _refusal(**changes)
    assert fragment in message and "--cuda-graph-impl none" in message


def test_cuda_graphs_of_other_parts_are_allowed():
    margs.validate_megatron_args(
        _args(cuda_graph_impl="transformer_engine", cuda_graph_scope=["mlp"])
    )


@pytest.mark.parametrize("builder", [None, "mamba"])
def test_builders_the_patch_does_not_cover_are_refused(builder):
    message = _refusal(charm_model_builder=builder)
    assert "pretrain_gpt.py" in message and "Mamba" in message


def test_modelopt_builder_is_refused():
    assert "ModelOpt" in _refusal(modelopt_enabled=True)


def test_hierarchical_sizes_three_levels_refused_two_accepted():
    message = _refusal(hierarchical_context_parallel_sizes=[2, 2, 2])
    assert "--hierarchical-context-parallel-sizes 2 2 2" in message
    assert "--charm-ranks-per-node" in message
    margs.validate_megatron_args(_args(hierarchical_context_parallel_sizes=[4, 2]))
    margs.validate_megatron_args(
        _args(hierarchical_context_parallel_sizes=[2, 2, 2], charm_ranks_per_node=4)
    )


def test_local_impl_without_apex_needs_no_gradient_accumulation_fusion():
    has_apex = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    local = dict(transformer_impl="local", gradient_accumulation_fusion=True)
    if has_apex:
        margs.validate_megatron_args(_args(**local))
    else:
        assert "--no-gradient-accumulation-fusion" in _refusal(**local)
    no_fusion = dict(transformer_impl="local", gradient_accumulation_fusion=False)
    margs.validate_megatron_args(_args(**no_fusion))


def test_unknown_and_per_layer_comm_types_are_refused():
    assert "use one of" in _refusal(cp_comm_type=["charmm"])
    assert "per-layer lists" in _refusal(cp_comm_type=["charm", "charm"])


def test_timeout_comes_from_distributed_timeout_minutes():
    assert margs.timeout_s_from_args(_args(distributed_timeout_minutes=3)) == 180.0
    assert "--distributed-timeout-minutes 0" in _refusal(distributed_timeout_minutes=0)


def test_timeout_reaches_the_attention_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = margs.apply_charm_from_args(
        get_gpt_layer_local_spec(), _args(distributed_timeout_minutes=3)
    )
    params = spec.submodules.self_attention.submodules.core_attention.params
    assert params["timeout_s"] == 180.0


# One test per plan flag: the flag reaches the PlanOptions of every layer, and a bad value names it.


def _core_attention_params(**changes) -> dict:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = margs.apply_charm_from_args(get_gpt_layer_local_spec(), _args(**changes))
    return spec.submodules.self_attention.submodules.core_attention.params


def test_charm_kernel_flag():
    # Megatron-LM's way to choose the block kernel (the module's kernel=): unset leaves it to
    # the module (MEGATRON_CHARM_KERNEL, else by device and dtype); refused without charm
    assert _core_attention_params(charm_kernel="math")["kernel"] == "math"
    assert _core_attention_params().get("kernel") is None
    parser = argparse.ArgumentParser()
    margs.add_megatron_arguments(parser.add_argument_group("distributed"))
    assert parser.parse_args(["--charm-kernel", "torch"]).charm_kernel == "torch"
    with pytest.raises(SystemExit):
        parser.parse_args(["--charm-kernel", "xformers"])
    with pytest.raises(ValueError, match="--charm-kernel only apply"):
        margs.validate_megatron_args(_args(cp_comm_type=["p2p"], charm_kernel="torch"))


def test_charm_window_flag():
    assert _core_attention_params(charm_window=4)["options"].window == 4
    assert _refusal(charm_window=0).startswith("--charm-window:")


def test_charm_cross_return_flag():
    assert _core_attention_params(charm_cross_return="input")["options"].cross_return == "input"
    assert _refusal(charm_cross_return="fp16").startswith("--charm-cross-return:")


def test_charm_cross_level_flag():
    assert _core_attention_params(charm_cross_level="kv")["options"].cross_level == "kv"
    assert _refusal(charm_cross_level="both").startswith("--charm-cross-level:")


def test_charm_combine_nodes_flag():
    params = _core_attention_params(charm_combine_nodes=True, charm_ranks_per_node=4)
    assert params["options"].combine_nodes is True
    four = _core_attention_params(charm_combine_nodes=True, charm_ranks_per_node=2)
    assert four["options"].combine_nodes is True
    assert "at least two nodes" in _refusal(charm_combine_nodes=True, charm_ranks_per_node=8)
    assert "charm option" in _refusal(cp_comm_type=["rm+"], charm_combine_nodes=True)


def test_charm_node_split_flag():
    assert _core_attention_params(charm_node_split="numa")["node_split"] == "numa"
    assert "node_split" not in _core_attention_params()  # host is the module's default


def test_charm_ranks_per_node_flag():
    assert _core_attention_params(charm_ranks_per_node=4)["ranks_per_node"] == 4
    assert "positive divisor" in _refusal(charm_ranks_per_node=3)


def test_plan_flags_default_to_the_planner_defaults():
    options = margs.plan_options_from_args(_args())
    assert options == PlanOptions(method="charm")


def test_charm_flags_without_charm_are_refused():
    message = _refusal(cp_comm_type=["p2p"], charm_window=4, charm_node_split="numa")
    assert "--charm-node-split" in message and "--charm-window" in message
    margs.validate_megatron_args(_args(cp_comm_type=["p2p"], attention_dropout=0.1))


def test_stock_comm_types_leave_the_spec_alone():
    sentinel = object()
    assert margs.apply_charm_from_args(sentinel, _args(cp_comm_type=["p2p"])) is sentinel
    assert margs.build_groups_from_args(_args(cp_comm_type=["a2a+p2p"])) is None


def test_parser_flags_match_megatron_defaults():
    parser = argparse.ArgumentParser()
    margs.add_megatron_arguments(parser.add_argument_group("distributed"))
    parsed = vars(parser.parse_args([]))
    defaults = margs.megatron_defaults()
    assert parsed == {k: defaults[k] for k in parsed}
    flags = parser.parse_args(["--charm-combine-nodes", "--charm-cross-level", "q"])
    assert flags.charm_combine_nodes and flags.charm_cross_level == "q"
