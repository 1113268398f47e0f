"""The ``pretrain_gpt.py`` command lines of ``docs/megatron-lm.md``, as the tests run them."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "megatron-lm.md"
_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
_MEGATRON_ARGS = re.compile(r"\$\(megatron-charm megatron-args([^)]*)\)")
_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass
class DocCommand:
    text: str
    """The command as written (continuation lines joined)."""
    env: dict[str, str]
    """Variables assigned in front of the command."""
    world_size: int
    """torchrun's ``--nnodes`` x ``--nproc-per-node``."""
    argv: list[str]
    """Everything after ``pretrain_gpt.py``, with ``$(megatron-charm megatron-args ...)``
    replaced by its output."""


def _megatron_args(overrides: str) -> list[str]:
    from megatron_charm.cli import megatron_lm_args
    from megatron_charm.train.config import load_config

    return megatron_lm_args(load_config(None, shlex.split(overrides)))


def doc_commands(doc: Path = DOC) -> list[DocCommand]:
    """Every documented command line that runs ``pretrain_gpt.py``."""
    commands = []
    for block in _BLOCK.findall(doc.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            if "pretrain_gpt.py" not in line or line.lstrip().startswith("#"):
                continue
            expanded = _MEGATRON_ARGS.sub(lambda m: shlex.join(_megatron_args(m.group(1))), line)
            words = shlex.split(expanded)
            env = {}
            while words and _ASSIGNMENT.match(words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            script = next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py"))
            launcher = words[:script]
            sizes = {"--nnodes": 1, "--nproc-per-node": 1}
            for flag in sizes:
                if flag in launcher:
                    sizes[flag] = int(launcher[launcher.index(flag) + 1])
            commands.append(
                DocCommand(
                    text=line.strip(),
                    env=env,
                    world_size=sizes["--nnodes"] * sizes["--nproc-per-node"],
                    argv=words[script + 1 :],
                )
            )
    return commands
