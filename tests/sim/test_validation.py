"""Validation helpers: the paper-row comparison and the testbed calibration."""

from __future__ import annotations

import pytest

from megatron_charm.sim.testbed import calibrate, compare
from megatron_charm.sim.topology import PRESETS
from megatron_charm.sim.validation import PAPER_ROWS, compare_row


def test_paper_rows_and_comparison() -> None:
    assert len(PAPER_ROWS) == 18
    row = next(r for r in PAPER_ROWS if r.gpu == "H20" and r.gpus == (2, 8) and r.seq == 1792)
    comps = compare_row(row, efficiency=0.5)
    assert [(c.method, c.backward) for c in comps] == [("rm+", False), ("charm", False)]
    assert comps[1].paper == pytest.approx(32.17 / 12.16)
    assert comps[1].predicted > 1.0  # charm beats ring across nodes on H20 links


def test_tasp_rows_of_table_5() -> None:
    # the paper's TASP forward (Table 5) on 2 x 8 H100; its sequences divide by n (n - 1)
    row = next(r for r in PAPER_ROWS if r.gpus == (2, 8) and r.seq == 13440)
    assert row.tasp_fwd == pytest.approx(49.27)
    comps = compare_row(row, efficiency=0.2, cross_links="rails")
    tasp = next(c for c in comps if c.method == "tasp")
    assert tasp.paper == pytest.approx(72.65 / 49.27)
    # one NIC per GPU: TASP's all-to-all spreads each step over every rail, ring uses one
    assert tasp.predicted > 1.0
    assert [c.method for c in compare_row(row, 0.2, "rails", tasp=False)] == ["charm", "charm"]


def _result(fwd_ms: dict[str, float]) -> dict:
    return {
        "layout": [2, 2],
        "topology": "shared",
        "cross_bps": 100e6,
        "pure_compute_s": {"fwd": 0.4, "fwdbwd": 2.4},
        "config": {
            "batch": 1,
            "seq_local": 1024,
            "heads": 4,
            "kv_heads": 4,
            "head_dim": 64,
            "dtype": "bf16",
            "causal": True,
        },
        "methods": {
            m: {"fwd": {"median": t / 1e3}, "fwdbwd": {"median": 3 * t / 1e3}}
            for m, t in fwd_ms.items()
        },
    }


def test_testbed_calibration_uses_probe_and_blocks() -> None:
    probe = {
        "phases": [
            {"name": "intra", "aggregate_bps": 8e9},
            {"name": "cross", "aggregate_bps": 9e7, "per_link_bps": 9e7},
        ]
    }
    cal = calibrate(_result({"ring": 1000.0}), probe)
    assert cal.topo.intra_bw == pytest.approx(1.0) and cal.topo.cross_bw == pytest.approx(0.01125)
    # 4 ranks, 4 causal blocks each of half a full block: 0.4 s / 2 full blocks.
    assert cal.compute.fwd_block == pytest.approx(0.2)
    assert cal.compute.bwd_block == pytest.approx(1.0)
    assert cal.problem.seq == 4096 and cal.source == "probe"


def test_testbed_compare_rows() -> None:
    rows = compare(_result({"ring": 1000.0, "charm": 700.0}), intra_gbps=1.0)
    assert {(r["method"], r["pass"]) for r in rows} == {
        (m, p) for m in ("ring", "charm") for p in ("fwd", "fwdbwd")
    }
    for r in rows:
        assert r["predicted_s"] > 0 and r["error"] == pytest.approx(
            r["predicted_s"] / r["measured_s"] - 1
        )


def test_testbed_needs_an_intra_rate() -> None:
    with pytest.raises(ValueError, match="--intra-gbps"):
        calibrate(_result({"ring": 1.0}))


def test_preset_paper_error_is_the_validation_worst_miss() -> None:
    """advise quotes each preset's ``paper_error`` as its known error: it must be the worst
    speedup error of that GPU's rows as the preset replays them (TASP aside: at most 7%)."""
    worst: dict[str, float] = {}
    for row in PAPER_ROWS:
        for c in compare_row(row, PRESETS[row.gpu].efficiency, tasp=False):
            worst[row.gpu] = max(worst.get(row.gpu, 0.0), abs(c.error))
    assert set(worst) == {"L20", "H20", "H100"}
    for gpu, err in worst.items():
        assert PRESETS[gpu].paper_error == pytest.approx(err, abs=0.005), gpu


def test_set_fields_replays_a_changed_preset(capsys: pytest.CaptureFixture) -> None:
    from megatron_charm.sim.validation import main, set_fields

    presets = set_fields(["H20.intra_bw=148.6", "H20.sms=40"])
    assert presets["H20"].intra_bw == 148.6 and presets["H20"].sms == 40
    assert isinstance(presets["H20"].sms, int) and PRESETS["H20"].intra_bw == 297.2
    assert set_fields(["H100.enqueue_us=50"])["H100"].enqueue.merge == pytest.approx(50e-6)
    bad_specs = ("H30.efficiency=0.3", "H20.name=0.3", "H20.efficiency=-1", "H20.efficiency")
    for bad in (*bad_specs, "H20.sms=1.5"):
        with pytest.raises(ValueError, match="--set"):
            set_fields([bad])

    def ring_ms(*extra: str) -> list[str]:
        assert main(["--gpus", "H20", "--set", "H20.efficiency=0.5", *extra]) == 0
        out = capsys.readouterr().out
        assert "H20 0.500" in out  # used as given, not fitted
        return [line.split("|")[11] for line in out.splitlines() if line.startswith("| 4 |")]

    assert ring_ms() != ring_ms("--set", "H20.intra_bw=148.6")
