"""Training configuration, data, schedule and launcher environment (pure, no ranks)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from megatron_charm.train.cli import build_parser, overrides_from_args, parse_args
from megatron_charm.train.config import Config, dump_config, load_config
from megatron_charm.train.data import (
    TINY_CORPUS_PREFIX,
    TINY_CORPUS_TEXT,
    read_documents,
    resolve_blend,
    write_indexed_dataset,
)
from megatron_charm.train.defaults import DEFAULT_CONFIG_YAML
from megatron_charm.train.launch import apply_slurm_env, launched_externally
from megatron_charm.train.metrics import flops_per_iteration
from megatron_charm.train.schedule import learning_rate
from megatron_charm.train.tokenizer import ByteTokenizer, padded_vocab_size

REPO = Path(__file__).resolve().parents[2]


def test_embedded_default_is_exactly_the_shipped_tiny_config():
    assert (REPO / "configs" / "gpt-tiny-cpu.yaml").read_text() == DEFAULT_CONFIG_YAML
    cfg = load_config()
    assert cfg.parallel.context_parallel_size == 4 and cfg.parallel.nproc == 4
    assert cfg.parallel.cp_comm_type == "charm"
    assert cfg.data.kind == "indexed" and cfg.data.path == ["tiny"]


def test_every_training_config_in_configs_loads_with_its_values():
    loaded = []
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if not (isinstance(data, dict) and {"model", "train"} <= data.keys()):
            continue
        resolved = load_config(path).to_dict()
        # Every value written in the file is the value the trainer uses.
        for section, values in data.items():
            for key, value in (values or {}).items():
                got = resolved[section][key]
                assert got == value or (isinstance(value, list) and got == list(value)), (
                    path,
                    section,
                    key,
                )
        loaded.append(path.name)
    assert {"gpt-tiny-cpu.yaml", "gpt-350m.yaml", "gpt-1.3b.yaml"} <= set(loaded), loaded


def test_defaults_do_not_resume_and_time_out_like_megatron():
    from megatron_charm.constants import DEFAULT_TIMEOUT_S

    # A config without a checkpoint section must not silently continue an earlier run.
    assert Config().checkpoint.resume is False
    assert load_config().checkpoint.resume is False
    assert Config().run.overwrite is False
    assert Config().parallel.timeout_s == DEFAULT_TIMEOUT_S
    assert load_config().parallel.timeout_s == DEFAULT_TIMEOUT_S


def test_overrides_and_round_trip(tmp_path):
    cfg = load_config(
        None,
        [
            "train.train_iters=7",
            "train.lr=1e-3",
            "parallel.cp_comm_type=rm+",
            "parallel.hierarchical_context_parallel_sizes=[2, 2]",
            "model.num_query_groups=2",
            "run.dir=somewhere",
        ],
    )
    assert cfg.train.train_iters == 7 and cfg.train.lr == pytest.approx(1e-3)
    assert cfg.parallel.hierarchical_context_parallel_sizes == [2, 2]
    assert cfg.run_dir == Path("somewhere") and cfg.checkpoint_dir == Path("somewhere/checkpoints")
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("train.nonsense=1", "unknown config key train.nonsense"),
        ("nosection.key=1", "unknown config section"),
        ("train.train_iters=ten", "expected an integer"),
        ("parallel.cp_comm_type=ulysses", "parallel.cp_comm_type='ulysses'"),
        ("model.seq_length=100", "divisible by 2 x context_parallel_size"),
        ("model.attention_dropout=0.1", "model.attention_dropout=0"),
        ("model.num_query_groups=3", "num_query_groups"),
        ("train.global_batch_size=6", "multiple of"),
        ("train.precision=fp8", "train.precision"),
        ("trainiters=3", "section.key"),
    ],
)
def test_bad_config_values_name_the_key(override, fragment):
    with pytest.raises(ValueError) as info:
        load_config(None, [override])
    assert fragment in str(info.value)


def test_cli_flags_become_overrides():
    args = build_parser().parse_args(
        [
            "--cp-comm-type",
            "ring",
            "--data-path",
            "0.5",
            "a/b",
            "0.5",
            "c/d",
            "--train-iters",
            "3",
            "--nproc",
            "2",
            "--resume",
            "model.hidden_size=32",
        ]
    )
    overrides = overrides_from_args(args)
    cfg_data = {o.split("=", 1)[0]: yaml.safe_load(o.split("=", 1)[1]) for o in overrides}
    assert cfg_data["parallel.cp_comm_type"] == "ring"
    assert cfg_data["data.path"] == ["0.5", "a/b", "0.5", "c/d"]
    assert cfg_data["train.train_iters"] == 3 and cfg_data["parallel.nproc"] == 2
    assert cfg_data["checkpoint.resume"] is True and cfg_data["model.hidden_size"] == 32
    # Positional overrides come after the flags, so they win.
    assert overrides[-1] == "model.hidden_size=32"


def test_overrides_may_follow_flags():
    args = parse_args(["train.lr=1e-3", "--resume", "model.hidden_size=32", "--overwrite"])
    assert args.resume and args.overwrite
    assert args.overrides == ["train.lr=1e-3", "model.hidden_size=32"]
    overrides = overrides_from_args(args)
    assert "checkpoint.resume=true" in overrides and "run.overwrite=true" in overrides
    cfg = load_config(None, overrides)
    assert cfg.train.lr == pytest.approx(1e-3) and cfg.model.hidden_size == 32
    assert cfg.checkpoint.resume and cfg.run.overwrite


def test_learning_rate_warmup_then_cosine():
    t = load_config(None, ["train.train_iters=20", "train.lr_warmup_iters=4"]).train
    lrs = [learning_rate(t, i) for i in range(20)]
    assert lrs[:4] == pytest.approx([t.lr * k / 4 for k in range(1, 5)])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert learning_rate(t, 20) == pytest.approx(t.min_lr)
    mid = 4 + (20 - 4) // 2
    assert lrs[mid] == pytest.approx((t.lr + t.min_lr) / 2)


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    text = "CHARM+ über alles"
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.eod == 256 and tok.vocab_size == 258
    assert padded_vocab_size(258, 64) == 320


def test_shipped_corpus_is_reproducible_from_its_text(tmp_path):
    docs = read_documents(TINY_CORPUS_TEXT.read_text(encoding="utf-8"))
    assert len(docs) >= 10
    bin_path, idx_path = write_indexed_dataset(docs, tmp_path / "corpus")
    assert bin_path.read_bytes() == TINY_CORPUS_PREFIX.with_suffix(".bin").read_bytes()
    assert idx_path.read_bytes() == TINY_CORPUS_PREFIX.with_suffix(".idx").read_bytes()

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(TINY_CORPUS_PREFIX))
    assert len(dataset) == len(docs)
    assert ByteTokenizer().detokenize(list(dataset[0][:-1])) == docs[0]


def test_data_path_resolution():
    assert resolve_blend(["tiny"]) == ([str(TINY_CORPUS_PREFIX)], None)
    assert resolve_blend(["0.3", "tiny", "0.7", "tiny"]) == (
        [str(TINY_CORPUS_PREFIX)] * 2,
        [0.3, 0.7],
    )
    with pytest.raises(ValueError, match="does not exist"):
        resolve_blend(["no/such/prefix"])


def test_slurm_environment_maps_to_torch_distributed():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_ID": "1234",
        "MASTER_ADDR": "node01",
    }
    assert launched_externally(env)
    apply_slurm_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "8", "1")
    assert env["LOCAL_WORLD_SIZE"] == "4" and env["MASTER_ADDR"] == "node01"
    assert env["MASTER_PORT"] == str(20000 + 1234)
    single = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    apply_slurm_env(single)
    assert "RANK" not in single and not launched_externally(single)


def test_flops_count_matches_the_closed_form():
    cfg = load_config(None, ["model.num_query_groups=4"])
    h, s, layers, v = 64, 128, 2, 320
    tokens = 4 * s
    per_layer = 2 * (4 * h * h + 8 * h * h) + 4 * s * h * 0.5
    expected = 3 * tokens * (layers * per_layer + 2 * h * v)
    assert math.isclose(flops_per_iteration(cfg, v, tokens), expected)


def test_progress_line_reports_position_and_eta():
    import io

    from megatron_charm.train.metrics import Progress

    progress = Progress(0, train_iters=100, out=io.StringIO())
    progress.start(20)
    assert "iteration 20/100 (20%)" in progress.line() and "eta unknown" in progress.line()
    progress.iteration = 30
    assert "eta " in progress.line() and "eta unknown" not in progress.line()
    progress.stop()


def test_gpu_only_options_are_refused_on_cpu(monkeypatch):
    import torch

    from megatron_charm.train.model import build_layer_spec, build_model
    from megatron_charm.train.setup import _dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # all_gather and a2a keep their Megatron-LM meaning: TE's (ours are cp_attention methods)
    for te_type in ("p2p", "all_gather", "a2a"):
        with pytest.raises(ValueError, match="Transformer Engine baseline"):
            build_layer_spec(load_config(None, [f"parallel.cp_comm_type={te_type}"]))
    with pytest.raises(ValueError, match="transformer_impl=local"):
        build_model(
            load_config(None, ["model.transformer_impl=transformer_engine"]),
            320,
            False,
            torch.float32,
        )
    with pytest.raises(ValueError, match="train.precision"):
        _dtype(load_config(None, ["train.precision=bf16"]), on_gpu=False)
    assert _dtype(load_config(), on_gpu=False) is torch.float32
    assert _dtype(load_config(), on_gpu=True) is torch.bfloat16


def test_plan_section_sets_plan_options_and_round_trips():
    from megatron_charm.train.config import config_from_dict, load_config

    cfg = load_config(None, ["plan.cross_level=kv", "plan.window=3", "plan.cross_return=input"])
    assert (cfg.plan.cross_level, cfg.plan.window, cfg.plan.cross_return) == ("kv", 3, "input")
    assert config_from_dict(cfg.to_dict()).plan == cfg.plan
    with pytest.raises(ValueError, match="cross_level='zz': expected one of auto, q, kv"):
        load_config(None, ["plan.cross_level=zz"])
    with pytest.raises(ValueError, match="the method is parallel.cp_comm_type"):
        load_config(None, ["plan.method=ring"])
