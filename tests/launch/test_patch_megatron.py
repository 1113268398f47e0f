"""Tests of ``megatron-charm patch-megatron`` on a small synthetic Megatron-LM lookalike.

No network and no Megatron-LM files: the tree holds a two-line ``pretrain_gpt.py`` and the
patch is generated here with ``git diff``.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_charm import cli

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
GIT_ID = ["-c", "user.name=test", "-c", "user.email=test@example.invalid"]
ORIGINAL = "def main():\n    return 'p2p'\n"
PATCHED = "def main():\n    return 'charm'\n"


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", *GIT_ID, *args], cwd=repo, check=True, capture_output=True)
    return out.stdout.decode().strip()


@pytest.fixture
def megatron_repo(tmp_path: Path) -> tuple[Path, Path]:
    """A git repository with ``pretrain_gpt.py`` and a patch that changes it."""
    repo = tmp_path / "Megatron-LM"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "pretrain_gpt.py").write_text(ORIGINAL)
    _git(repo, "add", "pretrain_gpt.py")
    _git(repo, "commit", "-q", "-m", "base")
    (repo / "pretrain_gpt.py").write_text(PATCHED)
    patch = tmp_path / "synthetic.patch"
    patch.write_text(_git(repo, "diff") + "\n")
    _git(repo, "checkout", "-q", "--", "pretrain_gpt.py")
    return repo, patch


def _run(repo: Path, patch: Path, **kw) -> tuple[str, str, str]:
    out, err = io.StringIO(), io.StringIO()
    head = _git(repo, "rev-parse", "HEAD") if (repo / ".git").exists() else "0" * 40
    kw.setdefault("expected_commit", head)
    status = cli.patch_megatron(repo, patch=patch, out=out, err=err, **kw)
    return status, out.getvalue(), err.getvalue()


@needs_git
def test_check_then_apply_then_idempotent(megatron_repo):
    repo, patch = megatron_repo
    status, out, err = _run(repo, patch, check_only=True)
    assert status == "applicable" and "applies cleanly" in out and err == ""
    assert (repo / "pretrain_gpt.py").read_text() == ORIGINAL

    assert _run(repo, patch)[0] == "applied"
    assert (repo / "pretrain_gpt.py").read_text() == PATCHED

    status, out, _ = _run(repo, patch)
    assert status == "already-applied" and "nothing to do" in out
    assert _run(repo, patch, check_only=True)[0] == "already-applied"
    assert (repo / "pretrain_gpt.py").read_text() == PATCHED


@needs_git
def test_other_commit_warns(megatron_repo):
    repo, patch = megatron_repo
    status, _, err = _run(repo, patch, check_only=True, expected_commit="f" * 40)
    assert status == "applicable"
    assert "warning" in err and cli.MEGATRON_TAG in err


@needs_git
def test_conflicting_tree_is_refused_and_left_alone(megatron_repo):
    repo, patch = megatron_repo
    edited = "def main():\n    return 'a2a'\n"
    (repo / "pretrain_gpt.py").write_text(edited)
    with pytest.raises(cli.CliError, match="does not apply"):
        _run(repo, patch)
    assert (repo / "pretrain_gpt.py").read_text() == edited


@needs_git
@pytest.mark.skipif(shutil.which("patch") is None, reason="patch(1) is not installed")
def test_plain_directory_uses_patch(megatron_repo, tmp_path):
    _, patch = megatron_repo
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "pretrain_gpt.py").write_text(ORIGINAL)
    status, out, _ = _run(plain, patch)
    assert status == "applied" and "not a git checkout" in out
    assert (plain / "pretrain_gpt.py").read_text() == PATCHED
    assert _run(plain, patch)[0] == "already-applied"


def test_not_a_megatron_checkout(tmp_path):
    with pytest.raises(cli.CliError, match="pretrain_gpt.py not found"):
        cli.patch_megatron(tmp_path, patch=tmp_path / "x.patch")
    with pytest.raises(cli.CliError, match="no such directory"):
        cli.patch_megatron(tmp_path / "missing", patch=tmp_path / "x.patch")


@needs_git
def test_main_exit_status(megatron_repo, tmp_path, capsys):
    repo, patch = megatron_repo
    assert cli.main(["patch-megatron", str(repo), "--check", "--patch", str(patch)]) == 0
    assert cli.main(["patch-megatron", str(tmp_path / "nowhere"), "--patch", str(patch)]) == 1
    assert "megatron-charm: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2


def test_shipped_patch_touches_only_the_builder_arguments_and_init():
    patch = cli.default_patch_path()
    text = patch.read_text()
    files = set(re.findall(r"^\+\+\+ b/(\S+)$", text, flags=re.M))
    assert files == {
        "gpt_builders.py",
        "megatron/training/arguments.py",
        "megatron/training/initialize.py",
        "pretrain_gpt.py",
    }
    added = "\n".join(line for line in text.splitlines() if line.startswith("+"))
    # The patch only calls into megatron_charm.megatron.args; every rule lives there.
    for call in (
        "add_megatron_arguments",
        "validate_megatron_args",
        "build_groups_from_args",
        "apply_charm_from_args",
    ):
        assert f"charm.{call}(" in added
        from megatron_charm.megatron import args as margs

        assert callable(getattr(margs, call))
    assert "'charm_model_builder': 'gpt'" in added and "CHARM_CP_COMM_TYPES" in added
    assert "pip install megatron-charm" not in text
