"""The megatron-core requirements in pyproject.toml (one per Python line, by environment marker)
admit the releases the compat check was verified against, within their minor release, and the
installed one."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_charm.megatron.compat import TESTED_MEGATRON_CORE, megatron_core_version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _requirements() -> list[Requirement]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return [Requirement(d) for d in deps if Requirement(d).name == "megatron-core"]


def test_each_tested_release_is_admitted_by_one_line_and_no_neighbouring_minor():
    reqs = _requirements()
    for version in TESTED_MEGATRON_CORE:
        admitting = [r for r in reqs if r.specifier.contains(version)]
        assert len(admitting) == 1, (version, [str(r) for r in reqs])
        tested = Version(version)
        spec = admitting[0].specifier
        assert not spec.contains(f"{tested.major}.{tested.minor - 1}.0")
        assert not spec.contains(f"{tested.major}.{tested.minor + 1}.0")


def test_python_lines_do_not_overlap():
    lines = [("3.10", 3, 10), ("3.11", 3, 11), ("3.12", 3, 12), ("3.13", 3, 13)]
    for name, *_ in lines:
        env = {"python_version": name, "python_full_version": name + ".0"}
        active = [r for r in _requirements() if r.marker is None or r.marker.evaluate(env)]
        assert len(active) == 1, (name, [str(r) for r in active])


def test_installed_megatron_core_is_within_the_pin_of_this_python():
    active = [r for r in _requirements() if r.marker is None or r.marker.evaluate()]
    assert len(active) == 1
    assert active[0].specifier.contains(megatron_core_version())
