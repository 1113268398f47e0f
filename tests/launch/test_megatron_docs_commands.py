"""The documented Megatron-LM commands and ``megatron-charm megatron-args`` emit flags that run.

Running them through the real patched ``parse_args``/``validate_args`` needs a Megatron-LM
checkout: ``test_megatron_lm_checkout.py`` does that when ``MEGATRON_LM_PATH`` is set.
"""

from __future__ import annotations

import pytest

from megatron_charm import cli
from megatron_charm.train.config import load_config
from tests.launch.doc_commands import DOC, doc_commands

PATCH = cli.default_patch_path()


def test_every_documented_command_sets_cuda_device_max_connections():
    commands = doc_commands()
    assert len(commands) >= 5
    for command in commands:
        assert command.env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", command.text
        assert "..." not in command.text, command.text


def test_install_route_is_from_source():
    for text in (DOC.read_text(), PATCH.read_text()):
        assert "pip install megatron-charm" not in text
    assert "pip install -e './megatron-charm[gpu]'" in DOC.read_text()
    assert "install it from its source tree" in PATCH.read_text()


def _flags(*overrides: str) -> list[str]:
    return cli.megatron_lm_args(load_config(None, ["data.kind=mock", *overrides]))


def test_local_impl_comes_with_no_gradient_accumulation_fusion():
    flags = _flags()
    assert flags[flags.index("--transformer-impl") + 1] == "local"
    assert "--no-gradient-accumulation-fusion" in flags
    te = _flags("model.transformer_impl=transformer_engine")
    assert "--no-gradient-accumulation-fusion" not in te


@pytest.mark.parametrize("baseline", ["p2p", "a2a", "all_gather"])
def test_te_baseline_gets_te_layers_and_no_charm_flags(baseline):
    flags = _flags(f"parallel.cp_comm_type={baseline}")
    assert flags[flags.index("--transformer-impl") + 1] == "transformer_engine"
    assert flags[flags.index("--cp-comm-type") + 1] == baseline
    assert not [f for f in flags if f.startswith("--charm-")]
    assert "--no-gradient-accumulation-fusion" not in flags


def test_plan_options_and_node_split_become_charm_flags():
    flags = _flags(
        "plan.window=4",
        "plan.cross_level=kv",
        "plan.cross_return=fp32",
        "plan.combine_nodes=true",
        "parallel.node_split=numa",
        "parallel.kernel=torch",
    )
    joined = " ".join(flags)
    for expected in (
        "--charm-kernel torch",
        "--charm-window 4",
        "--charm-cross-level kv",
        "--charm-cross-return fp32",
        "--charm-combine-nodes",
        "--charm-node-split numa",
    ):
        assert expected in joined
    assert "--charm-window" not in " ".join(_flags())  # defaults are left to the flags
    assert "--charm-kernel" not in " ".join(_flags())


def test_vocab_size_note_goes_to_stderr(capsys):
    assert cli.main(["megatron-args", "data.kind=mock"]) == 0
    out, err = capsys.readouterr()
    assert "--vocab-size 256" in out and "note" not in out
    assert "257 token ids" in err
