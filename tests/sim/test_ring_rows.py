"""Note [Constants from the ring rows]: H20's preset constants are what its ring rows give."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_charm.sim import ring_rows
from megatron_charm.sim.ring_rows import ring_constants
from megatron_charm.sim.topology import PRESETS
from megatron_charm.sim.validation import PAPER_ROWS, compare_row


def test_h20_preset_holds_its_ring_rows_constants() -> None:
    got = ring_constants("H20")
    hw = PRESETS["H20"]
    assert hw.efficiency == pytest.approx(got.efficiency, abs=5e-4)
    assert hw.intra_rate == pytest.approx(got.intra_rate, abs=5e-4)
    assert hw.cross_rate == pytest.approx(got.cross_rate, abs=5e-4)
    assert hw.intra_lat == pytest.approx(got.intra_lat, rel=0.01)
    assert hw.cross_lat == pytest.approx(got.cross_lat, rel=0.01)


def test_the_replay_gives_back_h20s_ring_times() -> None:
    # the constants come from a sum the replay states term by term: its ring times are the rows'
    for row in (r for r in PAPER_ROWS if r.gpu == "H20"):
        comp = compare_row(row, PRESETS["H20"].efficiency, tasp=False)[0]
        assert comp.ring_ms == pytest.approx(row.ring_fwd, rel=0.1), row


def test_ring_constants_recover_a_known_system(monkeypatch: pytest.MonkeyPatch) -> None:
    # rows made from known constants give them back, and too few rows are refused
    eff, intra, i_lat, cross, c_lat = 0.5, 0.4, 2e-4, 0.3, 8e-4
    hw = PRESETS["H20"]
    rows = []
    for gpus in ((1, 4), (1, 8), (2, 8)):
        for seq in (1792, 7168):
            row = dataclasses.replace(
                next(r for r in PAPER_ROWS if r.gpu == "H20"), gpus=gpus, seq=seq
            )
            n, flops, kv = ring_rows._terms(row)
            bw, lat = (hw.intra_bw * intra, i_lat) if gpus[0] == 1 else (hw.cross_bw * cross, c_lat)
            t = n * flops / (hw.tflops * 1e12 * eff) + (n - 1) * (lat + kv / (bw * 1e9))
            rows.append(dataclasses.replace(row, ring_fwd=t * 1e3))
    monkeypatch.setattr(ring_rows, "PAPER_ROWS", tuple(rows))
    got = ring_constants("H20")
    want = (eff, intra, i_lat, cross, c_lat)
    assert dataclasses.astuple(got) == pytest.approx(want, rel=1e-6)
    monkeypatch.setattr(ring_rows, "PAPER_ROWS", tuple(rows[:2] + rows[4:]))
    with pytest.raises(ValueError, match="at least 3 and 2"):
        ring_constants("H20")
