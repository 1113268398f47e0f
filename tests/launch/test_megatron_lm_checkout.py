"""The real patched Megatron-LM ``parse_args`` + ``validate_args``, when a checkout is given.

Set ``MEGATRON_LM_PATH`` to a Megatron-LM ``core_v0.16.1`` (Python 3.11, megatron-core 0.16.1) or
``core_v0.19.0`` (Python 3.12, megatron-core 0.19.x) checkout patched with
``megatron-charm patch-megatron``; without it these tests skip (the megatron-core wheel does not
ship ``megatron/training``). One subprocess (``megatron_lm_probe.py``, which stubs the GPU query
and Megatron-LM's training-loop imports) runs every case; the tests read its answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_charm.megatron import args as margs
from megatron_charm.megatron.tables import Cell, Cluster, pretrain_gpt_args
from tests.launch.doc_commands import doc_commands

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("megatron_lm_probe.py")
CHECKOUT = os.environ.get("MEGATRON_LM_PATH")

pytestmark = pytest.mark.skipif(
    not CHECKOUT,
    reason="set MEGATRON_LM_PATH to a patched Megatron-LM checkout (core_v0.16.1 or core_v0.19.0)",
)

ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
#: A small GPT with CP 8 on 8 ranks, as the docs' first command but shorter.
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 8 --train-iters 10 "
    "--lr 1e-4 --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 256 "
    "--context-parallel-size 8"
).split()
CHARM = [*BASE, "--cp-comm-type", "charm", "--attention-dropout", "0.0"]


def _case(argv: list[str], env: dict[str, str] | None = None, world_size: int = 8) -> dict:
    return {"argv": argv, "env": ENV if env is None else env, "world_size": world_size}


CASES: dict[str, dict] = {
    "charm": _case(CHARM),
    "no_max_connections": _case(CHARM, env={}),
    "default_dropout": _case([*BASE, "--cp-comm-type", "charm"]),
    "reset_attention_mask": _case([*CHARM, "--reset-attention-mask"]),
    "reset_without_mask": _case(
        [*CHARM, "--reset-attention-mask", "--no-create-attention-mask-in-dataloader"]
    ),
    "sft": _case([*CHARM, "--sft"]),
    "window": _case([*CHARM, "--window-size", "128,0"]),
    "window_skip": _case([*CHARM, "--window-size", "128,0", "--window-attn-skip-freq", "2"]),
    "mla": _case([*CHARM, "--multi-latent-attention"]),
    "hcp_three_levels": _case([*CHARM, "--hierarchical-context-parallel-sizes", "2", "2", "2"]),
    "hcp_two_levels": _case([*CHARM, "--hierarchical-context-parallel-sizes", "4", "2"]),
    "cuda_graph_local": _case([*CHARM, "--cuda-graph-impl", "local"]),
    "enable_cuda_graph": _case([*CHARM, "--enable-cuda-graph"]),
    "cuda_graph_mlp": _case(
        [*CHARM, "--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "mlp"]
    ),
    "deterministic": _case([*CHARM, "--deterministic-mode"], env={**ENV, "NCCL_ALGO": "Ring"}),
    "local_impl": _case([*CHARM, "--transformer-impl", "local"]),
    "local_impl_no_fusion": _case(
        [*CHARM, "--transformer-impl", "local", "--no-gradient-accumulation-fusion"]
    ),
    "timeout": _case([*CHARM, "--distributed-timeout-minutes", "3"]),
    "plan_flags": _case(
        [
            *CHARM,
            "--charm-window",
            "3",
            "--charm-cross-return",
            "input",
            "--charm-cross-level",
            "kv",
            "--charm-intra-level",
            "split",
            "--charm-foreign-q",
            "resend",
            "--charm-memory-budget",
            "1.5",
            "--charm-node-split",
            "numa",
            "--charm-ranks-per-node",
            "4",
            "--charm-combine-nodes",
        ]  # fmt: skip
    ),
    "bad_window": _case([*CHARM, "--charm-window", "0"]),
    "charm_flag_with_p2p": _case([*BASE, "--cp-comm-type", "p2p", "--charm-window", "4"]),
    "unknown_comm_type": _case([*BASE, "--cp-comm-type", "charmm", "--attention-dropout", "0"]),
    "p2p_baseline": _case([*BASE, "--cp-comm-type", "p2p"]),
    "auto": _case(
        [*BASE, "--cp-comm-type", "auto", "--attention-dropout", "0.0", "--charm-profile", "H100"]
    ),  # fmt: skip
    "auto_without_profile": _case([*BASE, "--cp-comm-type", "auto", "--attention-dropout", "0"]),
}
#: docs/megatron-lm.md's pretrain_gpt.py commands, megatron-args expanded, with their variables.
DOCS = {
    f"doc{i}": {
        "argv": c.argv,
        "env": {k: v for k, v in c.env.items() if k != "PYTHONPATH"},
        "world_size": c.world_size,
    }
    for i, c in enumerate(doc_commands())
}
CASES.update(DOCS)
#: The GPU path of Tables 6 and 7 (scripts/tables/megatron_tables.py): one point, every arm.
TABLES = {
    f"table-{method}": _case(
        pretrain_gpt_args(Cell(7, "GPT-350M", 16, 16384, method), Cluster()), world_size=16
    )
    for method in ("charm", "p2p", "a2a+p2p")
}
CASES.update(TABLES)


@pytest.fixture(scope="module")
def probe() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHECKOUT), str(ROOT)]))
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(CHECKOUT)],
        input=json.dumps(list(CASES.values())),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    if "charm_model_builder" not in out["results"][0].get("args", {}):
        pytest.skip(f"{CHECKOUT} is not patched: run megatron-charm patch-megatron first")
    return {"defaults": out["defaults"], **dict(zip(CASES, out["results"], strict=True))}


def _ok(probe: dict, name: str) -> dict:
    result = probe[name]
    assert result["ok"], result["error"]
    return result["args"]


def _error(probe: dict, name: str) -> str:
    result = probe[name]
    assert not result["ok"], f"{name} passed validate_args"
    return result["error"]


#: Options that core_v0.19.0 removed (None) or renamed (the new name). The rules read them with
#: getattr, so a removed flag counts as off, and the CUDA-graph check reads either name.
GONE_IN_0_19 = {"use_legacy_models": None, "cuda_graph_scope": "cuda_graph_modules"}


def test_namespace_defaults_are_megatrons(probe):
    parsed = probe["defaults"]
    ours = margs.megatron_defaults()
    absent = set(ours) - set(parsed)
    assert absent <= set(GONE_IN_0_19), absent
    for name in absent:
        new_name = GONE_IN_0_19[name]
        assert ours[name] is False if new_name is None else new_name in parsed, name
    assert {k: parsed[k] for k in ours if k in parsed} == {
        k: v for k, v in ours.items() if k in parsed
    }


def test_charm_run_passes_and_needs_cuda_device_max_connections(probe):
    args = _ok(probe, "charm")
    assert args["cp_comm_type"] == ["charm"] and args["charm_model_builder"] == "gpt"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in _error(probe, "no_max_connections")


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("default_dropout", "pass --attention-dropout 0"),
        ("reset_without_mask", "drop --no-create-attention-mask-in-dataloader"),
        ("window_skip", "--window-attn-skip-freq"),
        ("mla", "remove --multi-latent-attention"),
        ("hcp_three_levels", "--hierarchical-context-parallel-sizes 2 2 2"),
        ("cuda_graph_local", "--cuda-graph-impl none"),
        ("enable_cuda_graph", "--cuda-graph-impl none"),
        ("bad_window", "--charm-window:"),
        ("charm_flag_with_p2p", "--charm-window only apply"),
        ("unknown_comm_type", "'charmm' is unknown"),
        ("auto_without_profile", "needs --charm-profile"),
    ],
)
def test_refused_at_argument_time(probe, name, fragment):
    assert fragment in _error(probe, name)


def test_local_impl_without_apex(probe):
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        assert "--no-gradient-accumulation-fusion" in _error(probe, "local_impl")
    args = _ok(probe, "local_impl_no_fusion")
    assert args["gradient_accumulation_fusion"] is False


@pytest.mark.parametrize(
    "name",
    [
        "hcp_two_levels",
        "cuda_graph_mlp",
        "deterministic",
        "timeout",
        "p2p_baseline",
        "reset_attention_mask",
        "sft",
        "window",
    ],
)
def test_accepted(probe, name):
    _ok(probe, name)


@pytest.mark.parametrize("name", sorted(DOCS))
def test_documented_commands_pass_validate_args(probe, name):
    args = _ok(probe, name)
    assert args["cp_comm_type"] in (["charm"], ["p2p"])


@pytest.mark.parametrize("name", sorted(TABLES))
def test_table_runs_pass_validate_args(probe, name):
    args = _ok(probe, name)
    assert args["cp_comm_type"] == [name.removeprefix("table-")]


def test_patched_builder_swaps_in_charm_with_the_flags(probe):
    _ok(probe, "plan_flags")
    core = probe["plan_flags"]["core_attention"]
    assert core["module"] == "CharmDotProductAttention"
    assert core["params"]["ranks_per_node"] == 4 and core["params"]["node_split"] == "numa"
    assert core["params"]["timeout_s"] == 600.0
    assert core["params"]["options"] == {
        "method": "charm",
        "window": 3,
        "combine_nodes": True,
        "cross_return": "input",
        "cross_level": "kv",
        "intra_level": "split",
        "foreign_q": "resend",
        "memory_budget": 1.5,
    }
    _ok(probe, "timeout")
    assert probe["timeout"]["core_attention"]["params"]["timeout_s"] == 180
    _ok(probe, "p2p_baseline")
    assert probe["p2p_baseline"]["core_attention"]["module"] != "CharmDotProductAttention"
    _ok(probe, "auto")
    auto = probe["auto"]["core_attention"]
    assert auto["module"] == "CharmDotProductAttention"
    assert auto["params"]["profile"] == "H100" and auto["params"]["options"]["method"] == "charm"


def test_plan_flags_reach_the_args(probe):
    args = _ok(probe, "plan_flags")
    assert (
        args["charm_window"],
        args["charm_cross_return"],
        args["charm_cross_level"],
        args["charm_intra_level"],
        args["charm_foreign_q"],
        args["charm_memory_budget"],
        args["charm_node_split"],
        args["charm_ranks_per_node"],
        args["charm_combine_nodes"],
    ) == (3, "input", "kv", "split", "resend", 1.5, "numa", 4, True)
