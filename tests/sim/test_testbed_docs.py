"""The testbed comparison that docs/simulator.md quotes ("Where it stands", (c)) is what the
replay gives: a model or profile change that moves it must rewrite the committed tables
(docs/results/calibrated-2x2.md, "Three sweeps as one")."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_charm.sim.testbed import main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "results"
SWEEPS = ("sweep-xeon-20261206-d", "sweep-xeon-20261206-e", "sweep-xeon-20261206-f")
PAIRS = {
    "e-f-split": ("xeon-e-split", "xeon-f-split"),
    "g-h": ("xeon-g", "xeon-h"),
    "i-j": ("xeon-i", "xeon-j"),
}


def _body(text: str) -> str:
    """``text`` without its generation date, the one part that changes from run to run."""
    first, rest = text.split("\n", 1)
    return first.split(":", 1)[1] + "\n" + rest


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_the_committed_three_sweep_tables_are_what_the_replay_gives(pair, tmp_path) -> None:
    four, eight = PAIRS[pair]
    results = sorted(str(p) for s in SWEEPS for p in (DOCS / s).glob("*.json"))
    out = tmp_path / "got.md"
    args = [
        *results,
        "--profile",
        str(DOCS / "calibrate" / f"profile-2x2-shared-1gbit-{four}.json"),
        "--profile",
        str(DOCS / "calibrate" / f"profile-2x4-rails-1gbit-{eight}.json"),
        "--profile-rate",
        "1gbit",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    want = (DOCS / "calibrate" / f"sweeps-xeon-def-predicted-xeon-{pair}.md").read_text()
    assert _body(out.read_text()) == _body(want)
