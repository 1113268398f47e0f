"""Validation helpers: the paper-row comparison and the testbed calibration."""

from __future__ import annotations

import pytest

from megatron_charm.sim import validation as v
from megatron_charm.sim.testbed import calibrate, compare
from megatron_charm.sim.topology import PRESETS
from megatron_charm.sim.validation import PAPER_ROWS, compare_row
from tests.sim.testbed_results import bench_result


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


def test_testbed_calibration_uses_probe_and_blocks() -> None:
    probe = {
        "phases": [
            {"name": "intra", "aggregate_bps": 8e9},
            {"name": "cross", "aggregate_bps": 9e7, "per_link_bps": 9e7},
        ]
    }
    cal = calibrate(bench_result({"ring": 1000.0}), probe)
    assert cal.topo.intra_bw == pytest.approx(1.0) and cal.topo.cross_bw == pytest.approx(0.01125)
    # 4 ranks, 4 causal blocks each of half a full block: 0.4 s / 2 full blocks.
    assert cal.compute.fwd_block == pytest.approx(0.2)
    assert cal.compute.bwd_block == pytest.approx(1.0)
    assert cal.problem.seq == 4096 and cal.source == "probe"


def test_testbed_compare_rows() -> None:
    rows = compare(bench_result({"ring": 1000.0, "charm": 700.0}), intra_gbps=1.0)
    assert {(r["method"], r["pass"]) for r in rows} == {
        (m, p) for m in ("ring", "charm") for p in ("fwd", "fwdbwd")
    }
    # bench_result: forward medians of 1000 ms (ring) and 700 ms (charm), forward+backward
    # three times that; one run each, so no spread.
    measured = {(r["method"], r["pass"]): r["measured_s"] for r in rows}
    assert measured == pytest.approx(
        {
            ("ring", "fwd"): 1.0,
            ("ring", "fwdbwd"): 3.0,
            ("charm", "fwd"): 0.7,
            ("charm", "fwdbwd"): 2.1,
        }
    )
    for r in rows:
        assert r["runs_s"] == [r["measured_s"]] and r["spread"] == 0.0
        assert r["predicted_s"] > 0 and r["error"] > -1
        # the error is signed as the prediction's: positive when it is above the measurement
        assert (r["error"] > 0) == (r["predicted_s"] > r["measured_s"])


def test_testbed_needs_an_intra_rate() -> None:
    with pytest.raises(ValueError, match="--intra-gbps"):
        calibrate(bench_result({"ring": 1.0}))


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
    assert set_fields(["H20.cross_lat_on_link=0"])["H20"].cross_lat_on_link is False
    assert set_fields(["L20.cross_lat_on_link=1"])["L20"].cross_lat_on_link is True
    bad_specs = ("H30.efficiency=0.3", "H20.name=0.3", "H20.efficiency=-1", "H20.efficiency")
    for bad in (*bad_specs, "H20.sms=1.5", "H20.cross_lat_on_link=yes"):
        with pytest.raises(ValueError, match="--set"):
            set_fields([bad])

    def ring_ms(*extra: str) -> list[str]:
        assert main(["--gpus", "H20", "--set", "H20.efficiency=0.5", *extra]) == 0
        out = capsys.readouterr().out
        assert "H20 0.500" in out  # used as given, not fitted
        return [line.split("|")[11] for line in out.splitlines() if line.startswith("| 4 |")]

    assert ring_ms() != ring_ms("--set", "H20.intra_bw=148.6")


ROWS_HEADER = ",".join(v.ROW_COLUMNS)


def test_rows_from_a_csv_compare_as_the_papers_rows(tmp_path, capsys) -> None:
    # Table 5's first 2 x 8 row and a Table 4 row as a --rows file: the same comparisons as the
    # built-in rows, at the presets' efficiencies
    path = tmp_path / "rows.csv"
    path.write_text(
        ROWS_HEADER + "\n"
        "5,H100,2x8,16,26880,12,192,149.97,,63.93,449.58,141.52,98.01\n"
        "4,H20,2x8,16,1792,12,128,32.17,39.04,12.16,,,\n"
    )
    rows = v.load_rows(str(path))
    assert rows == (v.PAPER_ROWS[10], v.PAPER_ROWS[8])
    assert v.main(["--rows", str(path)]) == 0
    out = capsys.readouterr().out
    assert "the presets', not fitted" in out and "Within +-25%: 5 of 5" in out
    # the models behind the numbers: the unit, and per GPU type its links and compute
    assert "* Unit: one attention layer, one micro-batch" in out
    assert "* H100: links intra 365.1 GB/s" in out and "compute 989 TFLOPS x 0.68 " in out
    assert "* H20: links" in out and "compute 148 TFLOPS x 0.329 " in out
    want = v.compare_row(v.PAPER_ROWS[10], v.PRESETS["H100"].efficiency)
    for c in want:
        assert (
            f"| {c.method} | {'bwd' if c.backward else 'fwd'} | {c.paper:.2f} | "
            + (f"{c.predicted:.2f} |")
            in out
        )
    # times are counted for the Table 5 row only (4 of its: ring and charm in both passes, TASP)
    assert "Times within +-25%: 5 of 5" in out


def test_rows_read_numbers_as_the_paper_prints_them(tmp_path) -> None:
    # a table copied from the paper: its GPUs as 2 × 8, thousands separators, bold, and its dash
    # where a method has no measurement (TASP's backward)
    path = tmp_path / "rows.csv"
    path.write_text(
        ROWS_HEADER + "\n"
        '9,H100,2 \u00d7 8,16,"215,040",12,192,"1,763.17",,**1091.3**,"3,542.28",\u2013,-\n',
        encoding="utf-8-sig",  # as a spreadsheet exports it
    )
    (row,) = v.load_rows(str(path))
    assert (row.gpus, row.seq, row.ring_fwd, row.charm_fwd) == ((2, 8), 215040, 1763.17, 1091.3)
    assert row.ring_bwd == 3542.28 and row.charm_bwd is None and row.tasp_fwd is None
    # a header padded or capitalised by hand, with a column of its own (ignored) and the
    # appendix's CCR of a forward-only row (read as the forward's)
    header = " ".join(ROWS_HEADER.split(",")).title().replace(" ", " , ") + ",Notes , CCR"
    path.write_text(header + "\n5,H100,2x8,16,26880,12,192,149.97,,63.93,,,,peak,0.08\n")
    (row,) = v.load_rows(str(path))
    assert (row.ring_fwd, row.charm_fwd, row.tasp_fwd) == (149.97, 63.93, None)
    assert row.ccr == (("ccr_fwd", 0.08),)
    # a comma that is not a thousands separator stays an error
    path.write_text(ROWS_HEADER + '\n5,H100,2x8,16,26880,12,192,"149,97",,63.93,,,\n')
    with pytest.raises(ValueError, match="ring_fwd='149,97': a time in ms"):
        v.load_rows(str(path))


def test_rows_of_a_backward_only_table_compare_the_backward(tmp_path, capsys) -> None:
    # the appendix's backward tables (10 and 12) give ring's and CHARM+'s backward times only:
    # Table 5's first 2 x 8 row so written compares its backward speedup and times alone
    path = tmp_path / "rows.csv"
    path.write_text(ROWS_HEADER + "\n10,H100,2x8,16,26880,12,192,,,,449.58,141.52,\n")
    (row,) = v.load_rows(str(path))
    assert row.ring_fwd is None and row.charm_bwd == 141.52
    (comp,) = v.compare_row(row, v.PRESETS["H100"].efficiency)
    (want,) = [
        c for c in v.compare_row(v.PAPER_ROWS[10], v.PRESETS["H100"].efficiency) if c.backward
    ]
    assert comp.backward and comp.predicted == pytest.approx(want.predicted)
    assert v.main(["--rows", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Within +-25%: 1 of 1" in out and "Times within +-25%: 2 of 2" in out
    assert "| charm | bwd | 3.18 |" in out and "| fwd |" not in out


def test_rows_with_rings_ccr_compare_it_and_its_parts(tmp_path, capsys) -> None:
    # the appendix tables report ring's CCR, T_comp and T_comm (ms); here the ones Note [The
    # paper's baselines] reads from Table 5's 2 x 8 rows (C = 139.0, X = 10.96 ms forward)
    path = tmp_path / "rows.csv"
    header = ROWS_HEADER + "," + ",".join(v.CCR_COLUMNS)
    path.write_text(
        header + "\n5,H100,2x8,16,26880,12,192,149.97,,63.93,449.58,141.52,98.01,"
        "0.079,10.96,139.0,,,420\n"
    )
    (row,) = v.load_rows(str(path))
    assert row.ccr == (("ccr_fwd", 0.079), ("t_comp_fwd", 10.96), ("t_comm_fwd", 139.0),
                       ("t_comm_bwd", 420.0))  # fmt: skip
    comps = v.compare_ccr(row, v.PRESETS["H100"].efficiency)
    topo = v.row_topology(row)
    shape = v.Problem(16, 26880, 12, 192).shape(16)
    compute = v.PRESETS["H100"].compute_model(v.PRESETS["H100"].efficiency)
    (comp_f, comm_f), (_, comm_b) = (
        v.ccr_parts(topo, shape, compute, False, b) for b in (False, True)
    )
    assert [c.predicted for c in comps] == pytest.approx(
        [comp_f / comm_f, comp_f * 1e3, comm_f * 1e3, comm_b * 1e3]
    )
    # the replay's ring matches the paper's own C and X within a few percent
    assert all(abs(c.error) < 0.05 for c in comps[:3])
    # and beside it the same at Table 2's rates: the same blocks, faster transfers
    nominal = v.nominal_links(topo, 365.1, 42.5)
    (_, comm_f2), (_, comm_b2) = (
        v.ccr_parts(nominal, shape, compute, False, b) for b in (False, True)
    )
    assert [c.table2 for c in comps] == pytest.approx(
        [comp_f / comm_f2, comp_f * 1e3, comm_f2 * 1e3, comm_b2 * 1e3]
    )
    assert comm_f2 < 0.7 * comm_f
    assert v.main(["--rows", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Ring's CCR and its parts" in out and "4 and 1 of 4 within +-25%" in out
    assert "| 5 | H100 | 2x8 | 16 | 26880 | T_comm | bwd | 420 |" in out
    # a file without them prints no such table
    path.write_text(ROWS_HEADER + "\n5,H100,2x8,16,26880,12,192,149.97,,63.93,,,\n")
    assert v.load_rows(str(path))[0].ccr == ()
    assert v.main(["--rows", str(path)]) == 0
    assert "Ring's CCR" not in capsys.readouterr().out


def test_rows_take_a_bare_ccr_column_for_the_one_pass_of_a_row(tmp_path) -> None:
    # Table 10 (backward) as printed: ring's and CHARM+'s backward, CCR and its parts unnamed
    path = tmp_path / "rows.csv"
    path.write_text(
        ROWS_HEADER + ",ccr,t_comp,t_comm\n10,H100,2x8,16,26880,12,192,,,,449.58,141.52,,"
        "0.06,25,420\n"
    )
    (row,) = v.load_rows(str(path))
    assert row.ccr == (("ccr_bwd", 0.06), ("t_comp_bwd", 25.0), ("t_comm_bwd", 420.0))
    # with both passes the pass is not known
    path.write_text(
        ROWS_HEADER + ",ccr\n5,H100,2x8,16,26880,12,192,149.97,,63.93,449.58,141.52,,0.08\n"
    )
    with pytest.raises(ValueError, match="ccr='0.08': a CCR column without its pass"):
        v.load_rows(str(path))
    # named twice: refused
    path.write_text(
        ROWS_HEADER + ",ccr,ccr_fwd\n5,H100,2x8,16,26880,12,192,149.97,,63.93,,,,0.08,0.07\n"
    )
    with pytest.raises(ValueError, match="gives ccr_fwd as well"):
        v.load_rows(str(path))
    path.write_text(ROWS_HEADER + ",t_comm_fwd\n5,H100,2x8,16,26880,12,192,149.97,,63.93,,,,0\n")
    with pytest.raises(ValueError, match="t_comm_fwd='0': a CCR or a time in ms"):
        v.load_rows(str(path))


@pytest.mark.parametrize(
    "line, message",
    [
        ("5,A100,2x8,16,26880,12,192,149.97,,63.93,,,", "gpu='A100': not a preset"),
        ("5,H100,2x8,0,26880,12,192,149.97,,63.93,,,", "batch='0': must be a positive integer"),
        ("5,H100,2x8,16", "seq='': must be a positive integer"),  # a short line
        (
            "5,H100,2x8,16,26880,12,192,,,63.93,,,",
            "ring_fwd='': ring's forward time is required with charm_fwd",
        ),
        ("5,H100,2x8,16,26880,12,192,,,,,,", "ring_fwd='': ring's forward time is required"),
        ("5,H100,2x8,16,26880,12,192,149.97,,-1,,,", "charm_fwd='-1': a time in ms"),
        ("5,H100,2x8,16,26880,12,192,149.97,,63.93,,141.5,", "ring_bwd='': a backward speedup"),
        (
            "5,H100,2x8,16,26888,12,192,149.97,,63.93,,,",
            "seq='26888': --seq 26888 must be positive and divisible by 16",
        ),
        (
            "5,H100,2x8,16,1760,12,192,1,,1,,,1",
            r"tasp_fwd='1': the paper's TASP needs the sequence divisible by n \(n - 1\) = 240",
        ),
    ],
)
def test_rows_refuse_a_bad_value_naming_line_and_column(tmp_path, line, message) -> None:
    path = tmp_path / "rows.csv"
    path.write_text(ROWS_HEADER + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"rows.csv:2: {message}"):
        v.load_rows(str(path))
    path.write_text("table,gpu\n5,H100\n")
    with pytest.raises(ValueError, match="columns .* are missing"):
        v.load_rows(str(path))


def _doc_error_rows() -> list[tuple[str, tuple[int, int], int, str, bool, float, float]]:
    """``(gpu, gpus, seq, method, backward, paper, predicted)`` of the error table of (a) in
    docs/simulator.md ("Where it stands")."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "simulator.md").read_text()
    table = text.split("Errors of (a)", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        _, gpu, mxp, _, seq, method, passes, paper, predicted, _ = cells
        gpus = tuple(int(x) for x in mxp.split("x"))
        for p, a, b in zip(
            passes.split(" / "), paper.split(" / "), predicted.split(" / "), strict=True
        ):
            rows.append((gpu, gpus, int(seq), method, p == "bwd", float(a), float(b)))
    return rows


def test_the_docs_error_table_is_what_the_validation_gives() -> None:
    """docs/simulator.md quotes every speedup of Tables 4 and 5 as the presets replay them;
    a preset or model change that moves one must rewrite the table. TASP's 4 x 8 rows are left
    out here (a 32-rank TASP replay takes seconds each); the 2 x 8 ones stand for them."""
    doc = _doc_error_rows()
    assert len(doc) == 38
    got = {}
    for row in PAPER_ROWS:
        tasp = row.gpus != (4, 8)
        for c in compare_row(row, PRESETS[row.gpu].efficiency, tasp=tasp):
            got[(row.gpu, row.gpus, row.seq, c.method, c.backward)] = (c.paper, c.predicted)
    checked = 0
    for gpu, gpus, seq, method, backward, paper, predicted in doc:
        key = (gpu, gpus, seq, method, backward)
        if method == "tasp" and gpus == (4, 8):
            assert key not in got
            continue
        assert round(got[key][0], 2) == pytest.approx(paper), key
        assert round(got[key][1], 2) == pytest.approx(predicted), key
        checked += 1
    assert checked == len(got) == 34
