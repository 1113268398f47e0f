"""Trainer config rules (one test per rule) and YAML errors that name their source."""

from __future__ import annotations

import pytest

from megatron_charm.train.cli import preflight
from megatron_charm.train.config import load_config
from megatron_charm.train.validate import validate_config


@pytest.mark.parametrize(
    "key,value",
    [
        ("model.num_attention_heads", 0),
        ("model.num_query_groups", 0),
        ("model.num_query_groups", -2),
        ("model.hidden_size", -64),
        ("model.num_layers", 0),
        ("model.seq_length", 0),
        ("model.ffn_hidden_size", 0),
        ("train.micro_batch_size", 0),
        ("train.global_batch_size", 0),
        ("train.global_batch_size", -4),
        ("train.train_iters", 0),
        ("train.exit_interval", 0),
        ("train.exit_interval", -5),
        ("train.lr_decay_iters", 0),
        ("train.lr_warmup_iters", -1),
        ("parallel.timeout_s", 0),
        ("parallel.timeout_s", -1),
        ("parallel.timeout_s", ".nan"),
        ("parallel.nproc", 0),
        ("parallel.context_parallel_size", 0),
        ("parallel.ranks_per_node", 0),
        ("logging.log_interval", 0),
        ("checkpoint.save_interval", -1),
    ],
)
def test_non_positive_sizes_name_the_field(key, value):
    with pytest.raises(ValueError) as info:
        load_config(None, [f"{key}={value}"])
    message = str(info.value)
    assert message.startswith(f"{key}="), message
    assert f"set {key}" in message


def test_min_lr_above_lr_is_refused():
    with pytest.raises(ValueError, match=r"train.min_lr=0.1 exceeds train.lr"):
        load_config(None, ["train.min_lr=0.1", "train.lr=0.01"])


def test_node_split_must_be_known():
    with pytest.raises(ValueError, match=r"parallel.node_split='socket' is not one of host, numa"):
        load_config(None, ["parallel.node_split=socket"])
    assert load_config(None, ["parallel.node_split=numa"]).parallel.node_split == "numa"


def test_ranks_per_node_must_divide_cp():
    with pytest.raises(ValueError, match=r"parallel.ranks_per_node=3 does not divide"):
        load_config(None, ["parallel.ranks_per_node=3"])
    assert load_config(None, ["parallel.ranks_per_node=4"]).parallel.ranks_per_node == 4


@pytest.mark.parametrize("sizes", ["[2, 3]", "[8, 1]", "[0, 4]", "[2, 2, 2]"])
def test_hierarchical_sizes_must_multiply_to_cp(sizes):
    with pytest.raises(ValueError, match=r"multiply to parallel.context_parallel_size=4"):
        load_config(None, [f"parallel.hierarchical_context_parallel_sizes={sizes}"])


def test_hierarchical_sizes_that_multiply_to_cp_pass():
    cfg = load_config(None, ["parallel.hierarchical_context_parallel_sizes=[2, 2]"])
    assert cfg.parallel.hierarchical_context_parallel_sizes == [2, 2]


def test_nproc_must_be_a_multiple_of_cp():
    cfg = load_config(None, ["parallel.nproc=6"])  # fine on its own: no world size yet
    with pytest.raises(ValueError, match=r"context_parallel_size=4 does not divide .* 6"):
        validate_config(cfg, world_size=cfg.parallel.nproc)
    validate_config(load_config(None, ["parallel.nproc=8", "train.global_batch_size=8"]), 8)


def test_global_batch_must_cover_the_data_parallel_ranks():
    cfg = load_config(None, ["parallel.nproc=8"])  # DP 2 with micro-batch 4: needs 8
    with pytest.raises(ValueError, match=r"global_batch_size=4 must be a multiple of .*4 x 2"):
        validate_config(cfg, world_size=8)


def test_preflight_uses_the_launchers_world_size(tmp_path):
    cfg = load_config(None, [f"run.dir={str(tmp_path / 'run')!r}", "parallel.nproc=4"])
    preflight(cfg, externally_launched=False, environ={})
    with pytest.raises(ValueError, match="does not divide the number of ranks 6"):
        preflight(cfg, externally_launched=True, environ={"WORLD_SIZE": "6"})


def test_yaml_syntax_error_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  lr: [1e-3\n  train_iters: 5\n")
    with pytest.raises(ValueError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and "not valid YAML" in message and "line" in message


def test_yaml_syntax_error_in_an_override_names_the_override():
    with pytest.raises(ValueError) as info:
        load_config(None, ["data.path=[a, b"])
    assert "override 'data.path=[a, b'" in str(info.value)
    assert "not valid YAML" in str(info.value)


def test_a_config_file_that_is_not_a_mapping_is_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=f"config file {path} must be a mapping"):
        load_config(path, ["train.train_iters=3"])


def test_a_distributed_failure_in_training_is_one_line_with_status_1(tmp_path, monkeypatch, capsys):
    """A rank whose peer died reports the executor's error, not a traceback (the launcher names
    the rank that died)."""
    import torch

    from megatron_charm.comm.executor import DistributedError
    from megatron_charm.train import cli, loop

    def train(cfg):
        raise DistributedError("exchange #3 on channel intra.kv with cp_ranks [1] failed")

    monkeypatch.setattr(loop, "train", train)
    for name, value in {"RANK": "0", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    threads = torch.get_num_threads()
    try:
        status = cli.main([f"run.dir={tmp_path / 'run'}"])
    finally:
        torch.set_num_threads(threads)  # the rank entry point sets its own thread count
    err = capsys.readouterr().err
    assert status == 1
    assert "megatron-charm-train: error (rank 0): exchange #3 on channel intra.kv" in err
    assert "Traceback" not in err


# The Megatron-LM argument rules (megatron_charm.megatron.args) that exist as trainer keys.


def test_attention_dropout_is_refused_for_charm_methods():
    with pytest.raises(ValueError, match=r"model.attention_dropout=0.1: .*set model.attention_"):
        load_config(None, ["model.attention_dropout=0.1"])


def test_three_level_hierarchical_sizes_need_an_explicit_split():
    three = ["parallel.context_parallel_size=8", "parallel.nproc=8"]
    three.append("parallel.hierarchical_context_parallel_sizes=[2, 2, 2]")
    with pytest.raises(ValueError, match=r"CHARM\+ reads two levels"):
        load_config(None, [*three, "parallel.ranks_per_node=null"])
    cfg = load_config(None, [*three, "parallel.ranks_per_node=4"])
    assert cfg.parallel.hierarchical_context_parallel_sizes == [2, 2, 2]


def test_combine_nodes_needs_charm_on_two_or_more_nodes():
    for rpn in (2, 1):  # two and four nodes
        cfg = load_config(None, ["plan.combine_nodes=true", f"parallel.ranks_per_node={rpn}"])
        assert cfg.plan.combine_nodes
    with pytest.raises(ValueError, match=r"needs at least two nodes.*makes 1"):
        load_config(None, ["plan.combine_nodes=true", "parallel.ranks_per_node=4"])
    with pytest.raises(ValueError, match=r"is a charm option"):
        load_config(None, ["plan.combine_nodes=true", "parallel.cp_comm_type=rm+"])


def test_channel_group_timeout_is_parallel_timeout_s():
    from megatron_charm.train.model import build_layer_spec

    cfg = load_config(None, ["parallel.timeout_s=90"])
    params = build_layer_spec(cfg).submodules.self_attention.submodules.core_attention.params
    assert params["timeout_s"] == 90.0


def test_auto_needs_a_profile_and_reaches_the_attention_spec():
    from megatron_charm.train.model import build_layer_spec

    with pytest.raises(ValueError, match=r"parallel.cp_comm_type='auto' with parallel.profile"):
        load_config(None, ["parallel.cp_comm_type=auto"])
    with pytest.raises(ValueError, match=r"neither a preset"):
        load_config(None, ["parallel.cp_comm_type=auto", "parallel.profile=missing.json"])
    with pytest.raises(ValueError, match=r"set both or neither"):
        load_config(None, ["parallel.profile=H100"])
    cfg = load_config(None, ["parallel.cp_comm_type=auto", "parallel.profile=H100"])
    params = build_layer_spec(cfg).submodules.self_attention.submodules.core_attention.params
    assert params["method"] == "auto" and params["profile"] == "H100"
