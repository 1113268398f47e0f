"""The megatron-core requirement in pyproject.toml admits the releases the compat check was
verified against, within their minor release, and the installed one."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_charm.megatron.compat import TESTED_MEGATRON_CORE, megatron_core_version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _requirement() -> Requirement:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "megatron-core"]
    return req


def test_pin_admits_the_tested_releases_and_no_other_minor_release():
    spec = _requirement().specifier
    for version in TESTED_MEGATRON_CORE:
        assert spec.contains(version)
    oldest = min(Version(v) for v in TESTED_MEGATRON_CORE)
    assert not spec.contains(f"{oldest.major}.{oldest.minor - 1}.0")
    assert not spec.contains(f"{oldest.major}.{oldest.minor + 1}.0")


def test_installed_megatron_core_is_within_the_pin():
    assert _requirement().specifier.contains(megatron_core_version())
