"""Fast checks of the launch scripts: syntax, shellcheck, dry runs and the config translation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_charm import cli

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "scripts" / "launch"
SHELL_SCRIPTS = sorted(
    [*LAUNCH.glob("*.sh"), *LAUNCH.glob("*.sbatch"), *(REPO / "scripts" / "slurm").glob("*.sh")]
)


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    full_env.pop("SLURM_JOB_ID", None)
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    """The trainer's default config, written out as a file."""
    from megatron_charm.train.config import dump_config, load_config

    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text(dump_config(load_config(None)))
    return path


def test_scripts_parse():
    assert len(SHELL_SCRIPTS) >= 5
    for script in SHELL_SCRIPTS:
        assert _run(["bash", "-n", str(script)]).returncode == 0, script


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_clean():
    proc = _run(["shellcheck", *map(str, SHELL_SCRIPTS)])
    assert proc.returncode == 0, proc.stdout


def test_torchrun_train_dry_run(config_file):
    script = str(LAUNCH / "torchrun_train.sh")
    proc = _run([script, "--nproc", "2", "--dry-run", str(config_file), "train.train_iters=3"])
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert "--standalone" in words and "--nproc-per-node=2" in words
    assert words[words.index("--module") + 1] == "megatron_charm.train"
    assert words[-3:] == ["--config", str(config_file), "train.train_iters=3"]

    env = {"NNODES": "2", "MASTER_ADDR": "node7", "NPROC_PER_NODE": "3"}
    proc = _run([script, "--dry-run", str(config_file)], **env)
    assert "--rdzv-endpoint=node7:29500" in proc.stdout and "--nnodes=2" in proc.stdout
    assert "--nproc-per-node=3" in proc.stdout


def test_torchrun_train_bad_input(config_file, tmp_path):
    script = str(LAUNCH / "torchrun_train.sh")
    proc = _run([script, "--dry-run", str(tmp_path / "missing.yaml")])
    assert proc.returncode == 2 and "not found" in proc.stderr
    proc = _run([script, "--nproc", "zero", "--dry-run", str(config_file)])
    assert proc.returncode == 2 and "positive integer" in proc.stderr


def test_torchrun_megatron_dry_run(config_file, tmp_path):
    megatron = tmp_path / "Megatron-LM"
    (megatron / "megatron" / "training").mkdir(parents=True)
    (megatron / "pretrain_gpt.py").write_text("")
    (megatron / "megatron" / "training" / "arguments.py").write_text("")
    cmd = [str(LAUNCH / "torchrun_megatron.sh"), "--nproc", "4", "--dry-run", str(config_file)]
    proc = _run([*cmd, "data.kind=mock", "--", "--no-gradient-accumulation-fusion"],
                MEGATRON_LM=str(megatron))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "not patched" in proc.stderr
    words = proc.stdout.split()
    assert words[0] == "CUDA_DEVICE_MAX_CONNECTIONS=1"  # validate_args needs it with CP
    assert str(megatron / "pretrain_gpt.py") in words
    assert words[words.index("--cp-comm-type") + 1] == "charm"
    assert "--mock-data" in words and words[-1] == "--no-gradient-accumulation-fusion"

    proc = _run(cmd, MEGATRON_LM=str(megatron))  # the shipped byte corpus is refused
    assert proc.returncode != 0 and "data.path=[tiny]" in proc.stderr
    proc = _run(cmd, MEGATRON_LM=str(tmp_path))
    assert proc.returncode == 2 and "pretrain_gpt.py" in proc.stderr


def test_sbatch_scripts_refuse_to_run_outside_slurm(config_file):
    proc = _run(["bash", str(LAUNCH / "slurm_train.sbatch"), str(config_file)])
    assert proc.returncode == 2 and "sbatch" in proc.stderr
    proc = _run(["bash", str(LAUNCH / "slurm_megatron.sbatch"), str(config_file)])
    assert proc.returncode != 0 and "sbatch" in proc.stderr


def test_megatron_lm_args_translation():
    from megatron_charm.train.config import load_config

    cfg = load_config(
        None,
        [
            "data.kind=mock",
            "model.num_query_groups=2",
            "parallel.ranks_per_node=2",
            "parallel.hierarchical_context_parallel_sizes=[2, 2]",
            "train.precision=fp32",
            "checkpoint.resume=true",
        ],
    )
    flags = cli.megatron_lm_args(cfg)
    joined = " ".join(flags)
    assert "--group-query-attention --num-query-groups 2" in joined
    assert "--charm-ranks-per-node 2" in joined
    assert "--hierarchical-context-parallel-sizes 2 2" in joined
    assert "--context-parallel-size 4 --cp-comm-type charm" in joined
    assert "--bf16" not in flags and "--load" in flags
    assert (
        flags[flags.index("--seq-length") + 1]
        == flags[flags.index("--max-position-embeddings") + 1]
    )

    indexed = cli.megatron_lm_args(load_config(None, ["data.path=['0.5', 'a', '0.5', 'b']"]))
    assert indexed[indexed.index("--data-path") + 1 :][:4] == ["0.5", "a", "0.5", "b"]
    assert "--bf16" in indexed
    with pytest.raises(ValueError, match="byte-level test corpus"):
        cli.megatron_lm_args(load_config(None))


def test_check_metrics(tmp_path):
    script = str(REPO / "scripts" / "slurm" / "check_metrics.py")
    falling = [{"iteration": i, "loss": 5.0 - 0.3 * i} for i in range(10)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, falling)) + "\n")
    proc = _run([sys.executable, script, str(tmp_path)])
    assert proc.returncode == 0 and "metrics OK" in proc.stdout
    flat = [{"iteration": i, "loss": 5.0} for i in range(10)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, flat)) + "\n")
    proc = _run([sys.executable, script, str(tmp_path)])
    assert proc.returncode == 1 and "did not fall" in proc.stderr
