"""Every predicted speedup with its range from the model's known error (issue: honest
uncertainty): the table's ``range`` columns, ``speedup_range_vs_ring`` and ``uncertainty`` in
``--json``, and none where the hardware numbers are guesses."""

from __future__ import annotations

import pytest

from megatron_charm.sim.cli import format_table, hardware_error, main
from megatron_charm.sim.predict import Problem, predict, speedup_range
from megatron_charm.sim.profile import preset_profile
from megatron_charm.sim.programs import SYMMETRIC_ERROR
from megatron_charm.sim.topology import PRESETS
from tests.sim.cli_json import run_json

PROBLEM = ["--seq", "8192", "--heads", "8", "--head-dim", "64", "--causal"]
FLAGS = ["--gpus", "2x2", "--intra-bw", "100", "--cross-bw", "10", "--tflops", "100"]


def test_a_preset_puts_a_range_on_every_speedup_but_ring_s(capsys) -> None:
    err = PRESETS["H100"].paper_error
    data = run_json(capsys, ["--preset", "H100", "--gpus", "2x2", *PROBLEM])
    said = data["uncertainty"]
    assert f"up to +-{err:.0%}" in said and "margin over the next method" in said
    ring = data["methods"].pop("ring")
    assert "speedup_range_vs_ring" not in ring["forward"]
    assert len(data["methods"]) >= 3
    for name, entry in data["methods"].items():
        for tag in ("forward", "backward"):
            s = entry[tag]["speedup_vs_ring"]
            lo, hi = entry[tag]["speedup_range_vs_ring"]
            # each of the two times off by err: (1 - e) / (1 + e) below, its inverse above
            assert lo == pytest.approx(s * (1 - err) / (1 + err)), (name, tag)
            assert hi == pytest.approx(s * (1 + err) / (1 - err)), (name, tag)

    assert main(["--preset", "H100", "--gpus", "2x2", *PROBLEM, "--methods", "charm"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("method"))
    assert header.split().count("range") == 2
    charm = next(line for line in out.splitlines() if line.startswith("charm "))
    cells = [c for c in charm.split() if c[0].isdigit() and "-" in c]
    s = data["methods"]["charm"]
    for cell, tag in zip(cells, ("forward", "backward"), strict=True):
        lo, hi = s[tag]["speedup_range_vs_ring"]
        assert cell == f"{lo:.2f}-{hi:.2f}x"
    assert f"known error ({err:.0%})" in out


def test_flags_alone_give_no_range_and_say_the_numbers_are_guesses(capsys) -> None:
    data = run_json(capsys, [*FLAGS, *PROBLEM])
    assert data["uncertainty"].startswith("hardware numbers: the flags given, not measured")
    for entry in data["methods"].values():
        assert "speedup_range_vs_ring" not in entry["forward"]
    assert main([*FLAGS, *PROBLEM]) == 0
    out = capsys.readouterr().out
    assert "range" not in next(line for line in out.splitlines() if line.startswith("method"))
    assert hardware_error(None) is None


def test_a_one_node_replay_widens_the_range_of_its_speedups() -> None:
    """A causal plan replayed for one node adds its known error to the hardware's; an exact
    replay of the same problem has the hardware's alone."""
    prof = preset_profile("H100")
    _, err = hardware_error(prof)
    topo = prof.topology(4, 4)
    problem = Problem(1, 4096 * 16, 8, 64, causal=True)
    one_node = predict(topo, problem, prof.compute_model(), ("ring", "charm"), full_max_ranks=8)
    full = predict(topo, problem, prof.compute_model(), ("ring", "charm"))

    def ratio(pred) -> float:
        lo, hi = speedup_range(pred, "charm", False, err)
        return hi / lo

    assert ratio(full) == pytest.approx(((1 + err) / (1 - err)) ** 2)
    c = (1 + err) * (1 + SYMMETRIC_ERROR["charm"]) - 1
    assert ratio(one_node) == pytest.approx(((1 + c) / (1 - c)) ** 2)
    lo, hi = speedup_range(one_node, "charm", True, err)
    assert lo < one_node.speedup("charm", True) < hi
    assert "range" in format_table(full, err) and "range" not in format_table(full)
