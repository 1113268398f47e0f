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


def _run(repo: Path, patch: Path | None, **kw) -> tuple[str, str, str]:
    out, err = io.StringIO(), io.StringIO()
    head = _git(repo, "rev-parse", "HEAD") if (repo / ".git").exists() else "0" * 40
    kw.setdefault("releases", {"core_v9.9.9": head})
    status = cli.patch_megatron(repo, patch=patch, out=out, err=err, **kw)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture
def shipped(monkeypatch, tmp_path) -> Path:
    """A folder standing in for the shipped patches: ``default_patch_path`` reads from it."""
    folder = tmp_path / "shipped"
    folder.mkdir()
    monkeypatch.setattr(cli, "default_patch_path", lambda release: folder / cli.patch_name(release))
    return folder


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
def test_other_commit_with_explicit_patch_warns(megatron_repo):
    repo, patch = megatron_repo
    status, _, err = _run(repo, patch, check_only=True, releases={"core_v9.9.9": "f" * 40})
    assert status == "applicable"
    assert "warning" in err and "core_v9.9.9" in err


@needs_git
def test_unsupported_version_names_the_supported_tags(megatron_repo, shipped):
    repo, _ = megatron_repo
    _git(repo, "tag", "core_v0.17.1")
    releases = {"core_v0.16.1": "a" * 40, "core_v0.19.0": "b" * 40}
    with pytest.raises(cli.CliError) as info:
        _run(repo, None, releases=releases)
    message = str(info.value)
    assert "not a supported version" in message and "core_v0.17.1" in message
    assert "core_v0.16.1, core_v0.19.0" in message and "local changes" not in message
    assert (repo / "pretrain_gpt.py").read_text() == ORIGINAL


@needs_git
def test_tag_picks_its_patch(megatron_repo, shipped):
    repo, patch = megatron_repo
    # The other release's patch would fail: it expects a different file content.
    (shipped / cli.patch_name("core_v0.16.1")).write_text(patch.read_text().replace("p2p", "a2a"))
    (shipped / cli.patch_name("core_v0.19.0")).write_text(patch.read_text())
    _git(repo, "tag", "core_v0.19.0")
    releases = {"core_v0.16.1": "a" * 40, "core_v0.19.0": "b" * 40}
    status, out, err = _run(repo, None, releases=releases)
    assert status == "applied" and err == ""
    assert "Release core_v0.19.0: using megatron-lm-core_v0.19.0.patch" in out
    assert (repo / "pretrain_gpt.py").read_text() == PATCHED


@needs_git
def test_commit_without_tag_picks_its_patch(megatron_repo, shipped):
    repo, patch = megatron_repo
    (shipped / cli.patch_name("core_v0.16.1")).write_text(patch.read_text())
    head = _git(repo, "rev-parse", "HEAD")
    status, out, _ = _run(repo, None, check_only=True, releases={"core_v0.16.1": head})
    assert status == "applicable" and "Release core_v0.16.1" in out


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch(1) is not installed")
@needs_git
def test_plain_tree_is_told_by_its_version_file(megatron_repo, shipped, tmp_path):
    _, patch = megatron_repo
    (shipped / cli.patch_name("core_v0.19.0")).write_text(patch.read_text())
    plain = tmp_path / "plain-0.19"
    (plain / "megatron" / "core").mkdir(parents=True)
    (plain / "pretrain_gpt.py").write_text(ORIGINAL)
    info = plain / "megatron" / "core" / "package_info.py"
    info.write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\nPRE_RELEASE = ''\n")
    releases = {"core_v0.16.1": "a" * 40, "core_v0.19.0": "b" * 40}
    status, out, _ = _run(plain, None, releases=releases)
    assert status == "applied" and "version file 0.19.1" in out
    assert (plain / "pretrain_gpt.py").read_text() == PATCHED
    info.write_text("MAJOR = 0\nMINOR = 18\nPATCH = 2\n")
    with pytest.raises(cli.CliError, match="version file 0.18.2, .* not a supported version"):
        _run(plain, None, releases=releases)


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


#: Where each release's Megatron-LM picks the GPT layer spec (0.19 builds it in GPTModelBuilder).
SPEC_FILE = {"core_v0.16.1": "gpt_builders.py", "core_v0.19.0": "megatron/training/models/gpt.py"}


def test_every_release_has_a_shipped_patch():
    assert set(cli.MEGATRON_RELEASES) == set(SPEC_FILE)
    for release, commit in cli.MEGATRON_RELEASES.items():
        assert re.fullmatch(r"[0-9a-f]{40}", commit)
        assert cli.default_patch_path(release).name == f"megatron-lm-{release}.patch"


@pytest.mark.parametrize("release", sorted(SPEC_FILE))
def test_shipped_patch_touches_only_the_builder_arguments_and_init(release):
    patch = cli.default_patch_path(release)
    text = patch.read_text()
    files = set(re.findall(r"^\+\+\+ b/(\S+)$", text, flags=re.M))
    assert files == {
        SPEC_FILE[release],
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
