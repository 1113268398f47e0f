"""The simulator CLI's ``--json`` output, for the CLI tests."""

from __future__ import annotations

import json

import pytest

from megatron_charm.sim.cli import main


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    """The CLI's ``--json`` output for ``argv`` (``--json`` added where missing), after
    checking that it exits 0."""
    assert main([*argv, *(["--json"] * ("--json" not in argv))]) == 0
    return json.loads(capsys.readouterr().out)
