"""The ``megatron-charm`` command.

Subcommands:

``patch-megatron PATH [--check] [--patch FILE]``
    Apply megatron-charm's patch to a Megatron-LM checkout so that ``pretrain_gpt.py
    --cp-comm-type charm`` builds the CHARM+ attention spec. It tells the checkout's release
    (``core_v0.16.1`` or ``core_v0.19.0``) and applies that release's patch after a dry run; other
    versions are refused with the list of supported tags. Re-running on a patched tree is a no-op.

``megatron-args [--config CONFIG] [section.key=value ...] [--lines]``
    Print the Megatron-LM ``pretrain_gpt.py`` flags equivalent to a ``megatron-charm-train`` YAML
    config, so one config drives both trainers (the Megatron-LM launchers use this).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

#: The Megatron-LM releases a shipped patch was made against: tag -> commit. One patch per
#: release, ``patches/megatron-lm-<tag>.patch``; megatron-core 0.16.1 (Python 3.10/3.11) and 0.19.x
#: (Python >= 3.12) go with them.
MEGATRON_RELEASES: dict[str, str] = {
    "core_v0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
    "core_v0.19.0": "5be9626709af2722333bf54797c954c09edeada3",
}
#: The release of the examples in the docs (and of ``default_patch_path()`` without a release).
MEGATRON_TAG = "core_v0.16.1"
MEGATRON_COMMIT = MEGATRON_RELEASES[MEGATRON_TAG]


def patch_name(release: str) -> str:
    """File name of the shipped patch for a Megatron-LM release tag."""
    return f"megatron-lm-{release}.patch"


PATCH_NAME = patch_name(MEGATRON_TAG)


class CliError(Exception):
    """A user-facing failure: printed without a traceback, exit status 1."""


def default_patch_path(release: str = MEGATRON_TAG) -> Path:
    """Locate the shipped Megatron-LM patch of ``release`` (a tag of ``MEGATRON_RELEASES``).

    Looked up inside the package (package data), in the installation's data folder
    (``share/megatron-charm/patches``, setuptools data-files), then in the source tree's top-level
    ``patches/`` folder (editable installs and source checkouts).
    """
    name = patch_name(release)
    here = Path(__file__).resolve().parent
    candidates = (
        here / "patches",
        Path(sysconfig.get_path("data")) / "share" / "megatron-charm" / "patches",
        here.parent / "patches",
    )
    for folder in candidates:
        if (folder / name).is_file():
            return folder / name
    raise CliError(
        f"the Megatron-LM patch {name} is not installed with this copy of megatron-charm; "
        "pass it explicitly with --patch FILE (it is patches/" + name + " in the source tree)"
    )


#: Seconds a git (or patch) command may take: a hung one (a lock, a credential prompt, a network
#: file system) would otherwise hang the CLI for good.
RUN_TIMEOUT_S = 30


def _run(cmd: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a command, returning its exit status and combined output (a timeout: status 124, the
    ``timeout(1)`` convention, so callers take it as any other failure)."""
    try:
        proc = subprocess.run(
            list(cmd),
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        partial = (
            exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output
        )
        return 124, (
            f"`{' '.join(cmd)}` in {cwd} timed out after {RUN_TIMEOUT_S} s; check that the "
            f"repository is not locked by another git process\n{partial or ''}"
        ).strip()
    return proc.returncode, proc.stdout.strip()


def _git_toplevel(path: Path) -> Path | None:
    """Return the git work tree root containing ``path``, or None without git or a repository."""
    if shutil.which("git") is None:
        return None
    rc, out = _run(["git", "rev-parse", "--show-toplevel"], path)
    return Path(out).resolve() if rc == 0 and out else None


def describe_checkout(path: Path) -> str | None:
    """Return ``"<commit> (<tag>)"`` for a git checkout, or None when it cannot be told."""
    rc, commit = _run(["git", "rev-parse", "HEAD"], path)
    if rc != 0:
        return None
    rc, tag = _run(["git", "describe", "--tags", "--exact-match", "HEAD"], path)
    return f"{commit} ({tag})" if rc == 0 and tag else commit


def _version_file(root: Path) -> str | None:
    """``"MAJOR.MINOR.PATCH"`` from ``megatron/core/package_info.py``, or None."""
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    found = dict(re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", info.read_text(), flags=re.M))
    if len(found) != 3:
        return None
    return f"{found['MAJOR']}.{found['MINOR']}.{found['PATCH']}"


def detect_release(
    root: Path, in_git_repo: bool, releases: dict[str, str]
) -> tuple[str | None, str]:
    """The supported release a Megatron-LM tree is at, and how the tree was described.

    A git checkout is matched by its exact tag, else by its commit; a plain tree by the
    ``MAJOR.MINOR`` of its version file (the version file of tag ``core_v0.19.0`` says 0.19.1,
    so the patch level is not compared). ``None`` when the tree matches no release.
    """
    if in_git_repo:
        where = describe_checkout(root) or "an unknown commit"
        for tag, commit in releases.items():
            if where.startswith(commit) or where.endswith(f"({tag})"):
                return tag, where
        return None, where
    version = _version_file(root)
    if version is None:
        return None, "a tree that is not a git checkout and has no megatron/core/package_info.py"
    minor = version.rsplit(".", 1)[0]
    for tag in releases:
        if tag.removeprefix("core_v").rsplit(".", 1)[0] == minor:
            return tag, f"version file {version}, not a git checkout"
    return None, f"version file {version}, not a git checkout"


@dataclass
class _Applier:
    """The dry-run/apply commands of one tool, run in the Megatron-LM root."""

    check: list[str]
    reverse_check: list[str]
    apply: list[str]
    env: dict[str, str] | None = None

    @classmethod
    def for_tree(cls, root: Path, patch: Path, in_git_repo: bool) -> _Applier:
        if in_git_repo:
            git = ["git", "apply"]
            return cls(
                git + ["--check", str(patch)],
                git + ["--reverse", "--check", str(patch)],
                git + [str(patch)],
            )
        if shutil.which("patch") is not None:
            base = ["patch", "-p1", "--batch", "--silent", "-i", str(patch)]
            return cls(
                base + ["--forward", "--dry-run"],
                base + ["--reverse", "--dry-run"],
                base + ["--forward"],
            )
        if shutil.which("git") is not None:
            # Outside a repository `git apply` works like patch(1); the ceiling stops git from
            # adopting a repository that merely contains this folder.
            env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
            git = ["git", "apply"]
            return cls(
                git + ["--check", str(patch)],
                git + ["--reverse", "--check", str(patch)],
                git + [str(patch)],
                env,
            )
        raise CliError("neither `git` nor `patch` is installed; install one of them")


def patch_megatron(
    path: Path,
    *,
    patch: Path | None = None,
    check_only: bool = False,
    releases: dict[str, str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> str:
    """Apply the patch of the checkout's release to the Megatron-LM checkout at ``path``.

    The release is told by :func:`detect_release` among ``releases`` (tag -> commit; default
    ``MEGATRON_RELEASES``); ``patch`` overrides the shipped patch of that release.

    Returns ``"applied"``, ``"already-applied"`` or ``"applicable"`` (``check_only``).

    Raises:
        CliError: ``path`` is not a Megatron-LM checkout, it is at a release without a patch
            (and no ``patch`` was given), or the patch does not apply.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    releases = MEGATRON_RELEASES if releases is None else releases
    supported = ", ".join(releases)
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise CliError(f"{path}: no such directory; pass the root of a Megatron-LM clone")
    if not (root / "pretrain_gpt.py").is_file():
        raise CliError(
            f"{path} is not a Megatron-LM checkout (pretrain_gpt.py not found); pass the folder "
            f"created by `git clone --branch {MEGATRON_TAG} https://github.com/NVIDIA/Megatron-LM` "
            f"(supported tags: {supported})"
        )
    # Only a repository rooted exactly here lets `git apply` use the patch's paths as they are.
    in_git_repo = _git_toplevel(root) == root
    release, where = detect_release(root, in_git_repo, releases)
    print(f"Megatron-LM tree: {root} at {where}", file=out)
    if release is None and patch is None:
        raise CliError(
            f"Megatron-LM at {where} is not a supported version: megatron-charm ships patches for "
            f"the tags {supported} (`git -C {root} checkout <tag>`), or pass a patch you made "
            "with --patch FILE"
        )
    if release is None:
        print(
            f"warning: this Megatron-LM is none of the supported tags ({supported}); trying "
            f"{Path(patch).name} with a dry run first.",
            file=err,
        )
    patch_file = Path(patch).resolve() if patch is not None else default_patch_path(release)
    if not patch_file.is_file():
        raise CliError(f"patch file {patch} does not exist")
    if release is not None:
        print(f"Release {release}: using {patch_file.name}", file=out)

    tool = _Applier.for_tree(root, patch_file, in_git_repo)
    rc, forward_log = _run(tool.check, root, tool.env)
    if rc != 0:
        rc_rev, _ = _run(tool.reverse_check, root, tool.env)
        if rc_rev == 0:
            print(f"{patch_file.name} is already applied to {root}; nothing to do.", file=out)
            return "already-applied"
        cause = (
            f"Use a clean checkout of Megatron-LM {release} (`git -C {root} status` shows local "
            "changes)."
            if release is not None
            else f"Check out one of the supported tags ({supported})."
        )
        raise CliError(f"{patch_file.name} does not apply to {root}:\n{forward_log}\n{cause}")
    if check_only:
        print(f"{patch_file.name} applies cleanly to {root} (--check: nothing written).", file=out)
        return "applicable"
    rc, log = _run(tool.apply, root, tool.env)
    if rc != 0:
        raise CliError(f"applying {patch_file.name} failed after a clean dry run:\n{log}")
    print(f"Applied {patch_file.name} to {root}.", file=out)
    return "applied"


# Megatron-LM cannot read megatron-charm's byte-tokenized corpus; it ships with the package only.
_SHIPPED_CORPUS = "tiny"


#: Printed on stderr by ``megatron-args`` with mock data (stdout carries only the flags).
VOCAB_NOTE = (
    "note: --vocab-size 256 with --tokenizer-type NullTokenizer gives 257 token ids (256 + "
    "end-of-document), the vocabulary of megatron-charm-train's byte tokenizer, so both trainers "
    "build the same model; for GPT-2-sized embeddings append --vocab-size 50257"
)


def megatron_lm_args(cfg: Any) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` flags for a ``megatron_charm.train`` ``Config``.

    Tokenizer flags for real (indexed) data depend on the corpus; pass them after the config.
    A Transformer Engine ``cp_comm_type`` (the ``p2p``/``a2a``/``all_gather`` baselines) gets
    ``--transformer-impl transformer_engine``: Megatron-LM's local attention has no context
    parallelism. ``--transformer-impl local`` gets ``--no-gradient-accumulation-fusion``, which
    otherwise needs apex.

    Raises:
        ValueError: the config uses something only megatron-charm-train provides.
    """
    from megatron_charm.megatron.args import CHARM_CP_COMM_TYPES

    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    charm = p.cp_comm_type in CHARM_CP_COMM_TYPES
    impl = m.transformer_impl if charm else "transformer_engine"
    flags: list[Any] = [
        "--num-layers", m.num_layers,
        "--hidden-size", m.hidden_size,
        "--num-attention-heads", m.num_attention_heads,
        "--seq-length", m.seq_length,
        "--max-position-embeddings", m.seq_length,
        "--attention-dropout", m.attention_dropout,
        "--hidden-dropout", m.hidden_dropout,
        "--init-method-std", m.init_method_std,
        "--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by,
        "--transformer-impl", impl,
        "--context-parallel-size", p.context_parallel_size,
        "--cp-comm-type", p.cp_comm_type,
        "--distributed-timeout-minutes", max(1, int(p.timeout_s // 60)),
        "--seed", cfg.run.seed,
        "--micro-batch-size", t.micro_batch_size,
        "--global-batch-size", t.global_batch_size,
        "--train-iters", t.train_iters,
        "--lr", t.lr,
        "--min-lr", t.min_lr,
        "--lr-decay-style", "cosine",
        "--lr-warmup-iters", t.lr_warmup_iters,
        "--weight-decay", t.weight_decay,
        "--adam-beta1", t.adam_beta1,
        "--adam-beta2", t.adam_beta2,
        "--adam-eps", t.adam_eps,
        "--clip-grad", t.clip_grad,
        "--log-interval", cfg.logging.log_interval,
    ]  # fmt: skip
    if m.num_query_groups is not None:
        flags += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.ffn_hidden_size is not None:
        flags += ["--ffn-hidden-size", m.ffn_hidden_size]
    if impl == "local":
        flags.append("--no-gradient-accumulation-fusion")
    if charm:
        flags += _charm_flags(cfg)
    if p.hierarchical_context_parallel_sizes:
        flags += ["--hierarchical-context-parallel-sizes", *p.hierarchical_context_parallel_sizes]
    if t.lr_decay_iters is not None:
        flags += ["--lr-decay-iters", t.lr_decay_iters]
    if t.exit_interval is not None:
        flags += ["--exit-interval", t.exit_interval]
    if t.precision in ("auto", "bf16"):
        flags.append("--bf16")  # Megatron-LM trains on GPUs only, where auto means bf16
    if d.kind == "mock":
        flags += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 256]
    elif d.path == [_SHIPPED_CORPUS]:
        raise ValueError(
            f"data.path=[{_SHIPPED_CORPUS}] is megatron-charm's byte-level test corpus, which "
            "Megatron-LM cannot tokenize; set data.kind=mock, or data.path to your own "
            "Megatron .bin/.idx prefixes and pass their tokenizer flags after the config"
        )
    else:
        flags += ["--data-path", *d.path]
    if cfg.checkpoint.save:
        ckpt = str(cfg.checkpoint_dir)
        interval = cfg.checkpoint.save_interval or t.train_iters
        flags += ["--save", ckpt, "--save-interval", interval]
        if cfg.checkpoint.resume:
            flags += ["--load", ckpt]
    return [str(f) for f in flags]


def _charm_flags(cfg: Any) -> list[Any]:
    """The ``--charm-*`` flags of the config's node split, kernel and plan options
    (non-defaults)."""
    from megatron_charm.plan import PlanOptions

    p, plan, default = cfg.parallel, cfg.plan, PlanOptions()
    flags: list[Any] = []
    if p.ranks_per_node is not None:
        flags += ["--charm-ranks-per-node", p.ranks_per_node]
    if p.node_split != "host":
        flags += ["--charm-node-split", p.node_split]
    if p.kernel is not None:
        flags += ["--charm-kernel", p.kernel]
    keys = ("window", "cross_return", "cross_level", "intra_level", "foreign_q", "memory_budget")
    for key in keys:
        if getattr(plan, key) != getattr(default, key):
            flags += ["--charm-" + key.replace("_", "-"), getattr(plan, key)]
    if plan.combine_nodes:
        flags.append("--charm-combine-nodes")
    return flags


def _print_megatron_args(config: str | None, overrides: Sequence[str], lines: bool) -> None:
    from megatron_charm.train.config import load_config

    try:
        cfg = load_config(config, list(overrides))
        flags = megatron_lm_args(cfg)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    print("\n".join(flags) if lines else shlex.join(flags))
    if cfg.data.kind == "mock":
        print(VOCAB_NOTE, file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``megatron-charm`` command."""
    parser = argparse.ArgumentParser(
        prog="megatron-charm", description="megatron-charm utilities for Megatron-LM users."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "patch-megatron",
        help=f"patch a Megatron-LM checkout ({', '.join(MEGATRON_RELEASES)}) for --cp-comm-type "
        "charm",
        description=(
            "Apply megatron-charm's patch for the checkout's release "
            f"({', '.join(MEGATRON_RELEASES)}) to a Megatron-LM checkout. "
            "Runs a dry run first; does nothing if the patch is already applied."
        ),
    )
    p.add_argument("path", type=Path, help="root of the Megatron-LM checkout")
    p.add_argument("--check", action="store_true", help="only test whether the patch applies")
    p.add_argument("--patch", type=Path, default=None, help="patch file (default: the shipped one)")
    a = sub.add_parser(
        "megatron-args",
        help="print Megatron-LM pretrain_gpt.py flags for a megatron-charm-train config",
        description=(
            "Translate a megatron-charm-train YAML config into Megatron-LM pretrain_gpt.py "
            "flags (shell-quoted on one line, or one per line with --lines)."
        ),
    )
    a.add_argument("--config", help="YAML config (default: the embedded gpt-tiny-cpu config)")
    a.add_argument("--lines", action="store_true", help="one flag or value per line")
    a.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``megatron-charm`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "patch-megatron":
            patch_megatron(args.path, patch=args.patch, check_only=args.check)
        elif args.command == "megatron-args":
            _print_megatron_args(args.config, args.overrides, args.lines)
    except CliError as exc:
        print(f"megatron-charm: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
