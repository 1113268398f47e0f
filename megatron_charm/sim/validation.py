"""Validation (a): predicted vs published speedups (paper Tables 4 and 5).

Inputs are only Table 2 (bandwidths, TFLOPS, NVLink or PCIe) and at most one achieved-efficiency
factor per GPU type fitted on speedups, by :func:`fit_efficiency` (least squares on log speedup
over that GPU's rows): L20's. H100's and H20's come with their link constants from the paper's
own ring rows (Note [The paper's baselines] in :mod:`megatron_charm.sim.baselines`, Note
[Constants from the ring rows] in :mod:`megatron_charm.sim.ring_rows`). Table 4 does not state
batch size or heads; its rows use ``batch 16, 12 heads x 128`` (speedups depend on them only
through tiles and fixed costs; H20's rates from its ring rows hold for this shape). Table 5
states ``12 x 192`` heads and its batch sizes.

Ring and CHARM+ are replayed as the paper ran them (Note [The paper's baselines] in
:mod:`megatron_charm.sim.baselines`), and H100's efficiency comes from the paper's own numbers
there (H20's from its ring rows); ``--baselines ours`` replays our own ring and charm, with every
efficiency fitted.

Run: ``python -m megatron_charm.sim.validation [--cross-links rails|shared] [--causal]
[--baselines paper|ours] [--set GPU.FIELD=VALUE ...] [--rows FILE.csv] [--out FILE]``. ``--set``
replays with one preset field changed (``H100.efficiency=0.35``, ``H20.intra_bw=148.6``, a yes/no
field as 0 or 1: ``H20.cross_lat_on_link=0``): what-if runs of a constant's source; a set
efficiency is used as given, not fitted. ``--rows`` compares
other measurements of the same kind instead of Tables 4 and 5 (a CSV with the columns of
:data:`ROW_COLUMNS`, one row per measured point, times in ms, empty or the paper's dash where
none; numbers as the paper prints them, ``1,204.18`` or bold, read as plain ones), at the
presets' efficiencies (nothing is fitted on them). Its optional :data:`CCR_COLUMNS`, ring's CCR
and its parts as the paper's appendix tables report them, are compared in a table of their own.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import re
import time
from dataclasses import dataclass

from megatron_charm.plan.tasp import check_paper_tasp_shape
from megatron_charm.sim.baselines import PAPER_EFFICIENCY, paper_check_shape, paper_predict
from megatron_charm.sim.compute import ComputeModel, Enqueue, describe_compute
from megatron_charm.sim.predict import (
    Prediction,
    Problem,
    ccr_parts,
    ccr_ratio,
    describe_links,
    nominal_links,
    predict,
)
from megatron_charm.sim.topology import PRESETS, Hardware, Topology, parse_gpus


@dataclass(frozen=True)
class PaperRow:
    """One published measurement: times in ms (``None`` where the paper has none)."""

    table: str
    gpu: str
    gpus: tuple[int, int]
    batch: int
    seq: int
    heads: int
    head_dim: int
    ring_fwd: float | None
    rmp_fwd: float | None
    charm_fwd: float | None
    ring_bwd: float | None = None
    charm_bwd: float | None = None
    tasp_fwd: float | None = None
    ccr: tuple[tuple[str, float], ...] = ()
    """Ring's measured CCR and its parts, ``(column, value)`` for the :data:`CCR_COLUMNS` a
    ``--rows`` file gives (``T_comp`` and ``T_comm`` in ms)."""


def _t4(gpu: str, gpus: tuple[int, int], seq: int, ring: float, rmp: float, ours=None):
    return PaperRow("4", gpu, gpus, 16, seq, 12, 128, ring, rmp, ours)


def _t5(gpus: tuple[int, int], batch: int, seq: int, fwd: tuple, bwd: tuple, tasp: float):
    return PaperRow("5", "H100", gpus, batch, seq, 12, 192, fwd[0], None, fwd[1], *bwd, tasp)


# Table 4 (forward ms: ring, rm+, CHARM+) and Table 5 (forward and backward ms: ring, CHARM+;
# TASP's forward ms last: the paper has no TASP backward).
PAPER_ROWS: tuple[PaperRow, ...] = (
    _t4("L20", (1, 4), 1792, 9.35, 10.29),
    _t4("L20", (1, 4), 7168, 36.86, 39.66),
    _t4("L20", (2, 4), 1792, 17.61, 25.91, 14.81),
    _t4("L20", (2, 4), 7168, 69.85, 98.49, 52.40),
    _t4("H20", (1, 4), 1792, 5.38, 4.76),
    _t4("H20", (1, 4), 7168, 38.62, 33.20),
    _t4("H20", (1, 8), 1792, 5.51, 3.65),
    _t4("H20", (1, 8), 7168, 26.79, 13.84),
    _t4("H20", (2, 8), 1792, 32.17, 39.04, 12.16),
    _t4("H20", (2, 8), 7168, 84.58, 98.98, 28.91),
    _t5((2, 8), 16, 26880, (149.97, 63.93), (449.58, 141.52), 98.01),
    _t5((2, 8), 16, 13440, (72.65, 31.84), (226.46, 65.35), 49.27),
    _t5((2, 8), 64, 6720, (141.75, 61.80), (448.84, 123.32), 97.65),
    _t5((2, 8), 128, 3360, (140.55, 61.54), (450.01, 121.99), 97.15),
    _t5((4, 8), 16, 31744, (185.42, 68.17), (559.34, 146.01), 183.22),
    _t5((4, 8), 16, 15872, (89.27, 34.64), (279.85, 70.62), 93.30),
    _t5((4, 8), 64, 7936, (179.13, 66.48), (556.25, 134.48), 182.93),
    _t5((4, 8), 128, 3968, (178.51, 66.43), (560.63, 133.05), 183.09),
)


#: Columns of a ``--rows`` CSV: ``table`` (a label), ``gpu`` (a preset), ``gpus`` (``2x8``),
#: the shape, then forward and backward times in ms of ring, rm+, CHARM+ and TASP (empty where
#: not measured; ring's in every pass that has another method's, so a row of a backward-only
#: table leaves every forward column empty).
ROW_COLUMNS = (
    "table",
    "gpu",
    "gpus",
    "batch",
    "seq",
    "heads",
    "head_dim",
    "ring_fwd",
    "rmp_fwd",
    "charm_fwd",
    "ring_bwd",
    "charm_bwd",
    "tasp_fwd",
)

#: Optional columns of a ``--rows`` CSV: ring's CCR and its parts as the paper's appendix tables
#: report them (Eq. 7: ``T_comp`` its blocks, ``T_comm`` its kv transfers, each summed over the
#: steps and timed one after the other; ms), per pass. A row of a one-pass table may name them
#: without the pass (``ccr``, ``t_comp``, ``t_comm``): they are then that pass's.
CCR_COLUMNS = ("ccr_fwd", "t_comp_fwd", "t_comm_fwd", "ccr_bwd", "t_comp_bwd", "t_comm_bwd")
_CCR_BARE = ("ccr", "t_comp", "t_comm")

#: What the paper's tables print where a method has no measurement (Table 5's TASP backward).
NOT_MEASURED = frozenset({"-", "\u2013", "\u2014"})
_THOUSANDS = re.compile(r"\d{1,3}(,\d{3})+(\.\d*)?")


def _cell(text: str | None) -> str:
    """A cell as the paper prints it, read as a plain number: bold marks and thousands
    separators dropped (``**1,204.18**``), its dash for "not measured" as empty."""
    text = (text or "").strip().strip("*").strip()
    if text in NOT_MEASURED:
        return ""
    return text.replace(",", "") if _THOUSANDS.fullmatch(text) else text


def _parse_row(path: str, line: int, raw: dict) -> PaperRow:
    # a short line leaves fields None, a long one puts its extras under the key None
    rec = {k: _cell(v) for k, v in raw.items() if isinstance(k, str)}

    def bad(col: str, rule: str) -> ValueError:
        return ValueError(f"{path}:{line}: {col}={rec[col]!r}: {rule}; fix the row")

    if rec["gpu"] not in PRESETS:
        raise bad("gpu", f"not a preset ({', '.join(sorted(PRESETS))})")
    try:
        gpus = parse_gpus(rec["gpus"])
    except ValueError as err:
        raise bad("gpus", str(err)) from None
    ints = {}
    for col in ("batch", "seq", "heads", "head_dim"):
        try:
            ints[col] = int(rec[col])
        except ValueError:
            ints[col] = 0
        if ints[col] <= 0:
            raise bad(col, "must be a positive integer")
    times = {col: _positive(rec, col, bad, "a time in ms") for col in ROW_COLUMNS[7:]}
    forward = [c for c in ("rmp_fwd", "charm_fwd", "tasp_fwd") if times[c] is not None]
    if times["ring_fwd"] is None and (forward or times["ring_bwd"] is None):
        raise bad(
            "ring_fwd",
            f"ring's forward time is required{' with ' + forward[0] if forward else ''} "
            "(speedups are over it; a backward-only row gives ring_bwd instead)",
        )
    if times["charm_bwd"] is not None and times["ring_bwd"] is None:
        raise bad("ring_bwd", "a backward speedup needs ring's backward time")
    n = gpus[0] * gpus[1]
    try:
        shape = Problem(ints["batch"], ints["seq"], ints["heads"], ints["head_dim"]).shape(n)
    except ValueError as err:
        raise bad("seq", str(err)) from None
    if times["tasp_fwd"] is not None:
        try:
            check_paper_tasp_shape(shape.s_local, n)
        except ValueError as err:
            raise bad("tasp_fwd", str(err)) from None
    ccr = _parse_ccr(rec, times, bad)
    return PaperRow(rec["table"], rec["gpu"], gpus, **ints, **times, ccr=ccr)  # type: ignore[arg-type]


def _positive(rec: dict, col: str, bad, what: str) -> float | None:
    """The cell ``col`` of ``rec`` as a finite number > 0 (``what`` names it in the error),
    ``None`` where empty or absent."""
    text = rec.get(col) or ""
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise bad(col, f"{what} must be a finite number > 0, or empty")
    return value


def _parse_ccr(rec: dict, times: dict, bad) -> tuple[tuple[str, float], ...]:
    """The row's :data:`CCR_COLUMNS` that have a value; a bare column (``ccr``) names the pass
    of a row that has one."""
    passes = [tag for tag in ("fwd", "bwd") if times[f"ring_{tag}"] is not None]
    out: dict[str, float] = {}
    for col in (*CCR_COLUMNS, *_CCR_BARE):
        value = _positive(rec, col, bad, "a CCR or a time in ms")
        if value is None:
            continue
        name = col
        if col in _CCR_BARE:
            if len(passes) != 1:
                raise bad(
                    col,
                    "a CCR column without its pass needs a row of one pass (ring's time in one "
                    f"of ring_fwd, ring_bwd); name it {col}_fwd or {col}_bwd",
                )
            name = f"{col}_{passes[0]}"
            if name in out:
                raise bad(col, f"the row gives {name} as well; keep one of them")
        out[name] = value
    return tuple((c, out[c]) for c in CCR_COLUMNS if c in out)


def load_rows(path: str) -> tuple[PaperRow, ...]:
    """Measured rows from a CSV with :data:`ROW_COLUMNS` (``--rows``); ``ValueError`` naming
    the line and column of a bad value."""
    # utf-8-sig: a spreadsheet's export starts with a byte-order mark, which would rename "table"
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        # " Ring_fwd" names ring_fwd: a header typed by hand, or padded for alignment
        reader.fieldnames = [f.strip().lower() for f in reader.fieldnames or []]
        missing = [c for c in ROW_COLUMNS if c not in reader.fieldnames]
        if missing:
            raise ValueError(
                f"{path}: columns {missing} are missing; a --rows CSV has the header "
                f"{','.join(ROW_COLUMNS)}"
            )
        rows = tuple(_parse_row(path, line, rec) for line, rec in enumerate(reader, start=2))
    if not rows:
        raise ValueError(f"{path}: no rows under the header")
    return rows


#: What ring and charm replay: the paper's (Note [The paper's baselines]) or our own.
BASELINES = ("paper", "ours")


class _Paired:
    """A measured value (``paper``: the row's) and its prediction."""

    paper: float
    predicted: float

    @property
    def error(self) -> float:
        """Relative error of the prediction."""
        return self.predicted / self.paper - 1.0


@dataclass(frozen=True)
class CCRComparison(_Paired):
    """Predicted vs measured CCR, ``T_comp`` or ``T_comm`` (ms) of ring in one row."""

    row: PaperRow
    column: str
    """One of :data:`CCR_COLUMNS`."""
    paper: float
    predicted: float
    """At the row's links as the presets model them (the rates the paper's schedules achieve)."""
    table2: float
    """At Table 2's bandwidths with no fixed cost per transfer, as the paper's Eq. 9 counts a
    transfer (:func:`megatron_charm.sim.predict.nominal_links`): which of the two the paper's
    appendix columns hold, its text does not say (docs/simulator.md, ``CCR``)."""

    @property
    def table2_error(self) -> float:
        return self.table2 / self.paper - 1.0


def compare_ccr(
    row: PaperRow,
    efficiency: float,
    cross_links: str | None = None,
    causal: bool = False,
    presets: dict[str, Hardware] | None = None,
) -> list[CCRComparison]:
    """Pair each CCR column of ``row`` with the replay's (:func:`megatron_charm.sim.predict.
    ccr_parts`: ring's blocks at ``efficiency`` and its transfers on the row's links, and on
    them at Table 2's bandwidths)."""
    if not row.ccr:
        return []
    hw, topo, problem, compute = _row_model(row, efficiency, cross_links, causal, presets)
    shape = problem.shape(topo.cp_size)
    table2 = nominal_links(topo, hw.intra_bw, hw.cross_bw)

    def values(links: Topology, tag: str) -> dict[str, float]:
        comp, comm = ccr_parts(links, shape, compute, causal, tag == "bwd")
        return {"ccr": ccr_ratio((comp, comm)), "t_comp": comp * 1e3, "t_comm": comm * 1e3}

    out = []
    for column, measured in row.ccr:
        quantity, tag = column.rsplit("_", 1)
        got, nominal = values(topo, tag)[quantity], values(table2, tag)[quantity]
        out.append(CCRComparison(row, column, measured, got, nominal))
    return out


def ccr_markdown(comps: list[CCRComparison]) -> str:
    """The CCR comparisons as a Markdown table with its count within +-25%."""
    ok = sum(abs(c.error) <= 0.25 for c in comps)
    ok2 = sum(abs(c.table2_error) <= 0.25 for c in comps)
    lines = [
        f"Ring's CCR and its parts (the paper's Eq. 7: T_comp its blocks, T_comm its kv "
        f"transfers, ms, each summed over the steps), predicted on the presets' links and on "
        f"Table 2's bandwidths (Eq. 9's count; which of the two the paper's columns hold is not "
        f"known): {ok} and {ok2} of {len(comps)} within +-25%.",
        "",
        "| table | GPU | m x p | batch | seq | quantity | pass | measured | predicted | error | "
        "at Table 2's rates | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def err(e: float) -> str:
        return f"{e:+.0%}{'' if abs(e) <= 0.25 else ' (miss)'}"

    for c in comps:
        r, (quantity, tag) = c.row, c.column.rsplit("_", 1)
        lines.append(
            f"| {r.table} | {r.gpu} | {r.gpus[0]}x{r.gpus[1]} | {r.batch} | {r.seq} | "
            f"{quantity.replace('t_', 'T_')} | {tag} | {c.paper:.4g} | {c.predicted:.4g} | "
            f"{err(c.error)} | {c.table2:.4g} | {err(c.table2_error)} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Comparison(_Paired):
    """Predicted vs published speedup over ring of one method and pass of one row."""

    row: PaperRow
    method: str
    backward: bool
    paper: float
    predicted: float
    ring_ms: float
    method_ms: float


def row_topology(
    row: PaperRow, cross_links: str | None = None, presets: dict[str, Hardware] | None = None
) -> Topology:
    """Table 2 links of the row's GPU; ``cross_links``: "rails", "shared" or "nics:K";
    ``presets``: instead of :data:`PRESETS` (:func:`set_fields`)."""
    hw = (presets or PRESETS)[row.gpu]
    links, nics = cross_links or hw.cross_links, 0 if cross_links else hw.nics_per_node
    if links.startswith("nics:"):
        links, nics = "rails", int(links.split(":")[1])
        if row.gpus[0] == 1 or row.gpus[1] % nics:
            nics = 0
    return hw.topology(*row.gpus, cross_links=links, nics_per_node=nics)


def _row_model(
    row: PaperRow,
    efficiency: float,
    cross_links: str | None,
    causal: bool,
    presets: dict[str, Hardware] | None,
) -> tuple[Hardware, Topology, Problem, ComputeModel]:
    """The row's GPU, links, problem and compute at ``efficiency``."""
    hw = (presets or PRESETS)[row.gpu]
    problem = Problem(row.batch, row.seq, row.heads, row.head_dim, causal=causal)
    return hw, row_topology(row, cross_links, presets), problem, hw.compute_model(efficiency)


def compare_row(
    row: PaperRow,
    efficiency: float,
    cross_links: str | None = None,
    causal: bool = False,
    tasp: bool = True,
    baselines: str = "paper",
    presets: dict[str, Hardware] | None = None,
) -> list[Comparison]:
    """Simulate one paper row and pair every published speedup with its prediction (``tasp``:
    TASP's forward too, where the row has one; ``baselines``: ``"paper"`` replays ring and
    charm as the paper ran them, ``"ours"`` as our planner and executor run them; ``presets``:
    instead of :data:`PRESETS`)."""
    hw, topo, problem, compute = _row_model(row, efficiency, cross_links, causal, presets)
    wanted = [("rm+", False, row.rmp_fwd), ("charm", False, row.charm_fwd)]
    wanted.append(("charm", True, row.charm_bwd))
    if tasp:
        wanted.append(("tasp", False, row.tasp_fwd))
    wanted = [w for w in wanted if w[2] is not None]
    methods = tuple(sorted({"ring", *(m for m, _, _ in wanted)}))
    if baselines not in BASELINES:
        raise ValueError(
            f"baselines={baselines!r} is not one of {BASELINES}: 'paper' replays ring and charm "
            "as the paper ran them, 'ours' as our planner runs them; pass --baselines paper or ours"
        )
    if baselines == "paper":
        # TASP's all-to-all on the links its rows show, unless a link model is asked for
        a2a = hw.a2a_topology(*row.gpus) if cross_links is None else None
        pred: Prediction = paper_predict(topo, problem, compute, methods, a2a_topo=a2a)
    else:
        # the row's TASP is the paper's: its own shape rule, not our executor's stricter one
        pred = predict(topo, problem, compute, methods, check=paper_check_shape)
    out = []
    for method, bwd, paper_ms in wanted:
        ring_paper = row.ring_bwd if bwd else row.ring_fwd
        assert ring_paper is not None and paper_ms is not None
        ring_res = pred.methods["ring"].backward if bwd else pred.methods["ring"].forward
        res = pred.methods[method].backward if bwd else pred.methods[method].forward
        out.append(
            Comparison(
                row,
                method,
                bwd,
                ring_paper / paper_ms,
                ring_res.makespan / res.makespan,
                ring_res.makespan * 1e3,
                res.makespan * 1e3,
            )
        )
    return out


def _loss(comps: list[Comparison]) -> float:
    return sum(math.log(c.predicted / c.paper) ** 2 for c in comps)


def fit_efficiency(
    gpu: str,
    cross_links: str | None = None,
    causal: bool = False,
    lo: float = 0.2,
    hi: float = 0.8,
    baselines: str = "paper",
    presets: dict[str, Hardware] | None = None,
    efficiency: float | None = None,
    rows: tuple[PaperRow, ...] = PAPER_ROWS,
) -> tuple[float, list[Comparison]]:
    """Golden-section search of the efficiency that best fits ``gpu``'s rows (log speedups);
    with the paper's baselines, a GPU whose efficiency the paper's numbers give
    (:data:`megatron_charm.sim.baselines.PAPER_EFFICIENCY`) is not fitted.

    Both ends are priors: attention kernels reach at most about 75% of peak, and more than a
    fifth of it at these sizes. Below that the paper's own ring refutes the fit: L20's loss had
    its lowest point near 0.07 (2026-12-04), where ring's 1 x 4 forward grows 10-fold from 1,792
    to 7,168 tokens (its blocks dominate); the paper's grows 3.9-fold (its transfers do). Since
    its PCIe domain (2026-12-05, Note [One PCIe domain] in
    :mod:`megatron_charm.sim.topology`) L20's loss falls all the way to the upper end.
    TASP's rows are not fitted: they are predicted at the efficiency fitted on the others
    (replaying TASP's all-to-all steps at 32 GPUs takes seconds a row, too slow inside the
    search). ``presets``: instead of :data:`PRESETS`; ``efficiency``: used as given, not fitted;
    ``rows``: instead of Tables 4 and 5 (``--rows``).
    """
    rows = tuple(r for r in rows if r.gpu == gpu)

    def run(eff: float, tasp: bool = False) -> list[Comparison]:
        return [
            c
            for r in rows
            for c in compare_row(r, eff, cross_links, causal, tasp, baselines, presets)
        ]

    if efficiency is not None:
        return efficiency, run(efficiency, tasp=True)
    if baselines == "paper" and gpu in PAPER_EFFICIENCY:
        return PAPER_EFFICIENCY[gpu], run(PAPER_EFFICIENCY[gpu], tasp=True)

    a, b = lo, hi
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = _loss(run(c)), _loss(run(d))
    for _ in range(14):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = _loss(run(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = _loss(run(d))
    eff = round((a + b) / 2, 3)
    return eff, run(eff, tasp=True)


def markdown(
    fits: dict[str, tuple[float, list[Comparison]]],
    cross_links: str | None,
    causal: bool,
    baselines: str = "paper",
    rows: str | None = None,
    presets: dict[str, Hardware] | None = None,
) -> str:
    """The validation table (a) as Markdown; ``rows``: the ``--rows`` file the comparisons come
    from (at the presets' efficiencies), instead of Tables 4 and 5."""
    lines = [
        "| table | GPU | m x p | batch | seq | method | pass | paper speedup | predicted | "
        "error | predicted ring ms | paper ring ms | predicted ms | paper ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    n_ok = n = 0
    # absolute times: only where the paper states the shape (Table 5; Table 4's batch and heads
    # are assumed)
    times: dict[tuple, tuple[float, float]] = {}
    for gpu, (_, comps) in fits.items():
        for c in comps:
            r = c.row
            ring_paper = r.ring_bwd if c.backward else r.ring_fwd
            assert ring_paper is not None
            paper_ms = ring_paper / c.paper
            ok = abs(c.error) <= 0.25
            n_ok += ok
            n += 1
            if r.table != "4":  # Table 4 does not state its batch and heads
                times[(r, c.method, c.backward)] = (c.method_ms, paper_ms)
                times[(r, "ring", c.backward)] = (c.ring_ms, ring_paper)
            lines.append(
                f"| {r.table} | {gpu} | {r.gpus[0]}x{r.gpus[1]} | {r.batch} | {r.seq} | {c.method}"
                f" | {'bwd' if c.backward else 'fwd'} | {c.paper:.2f} | {c.predicted:.2f} | "
                f"{c.error:+.0%}{'' if ok else ' (miss)'} | {c.ring_ms:.2f} | {ring_paper:.2f} | "
                f"{c.method_ms:.2f} | {paper_ms:.2f} |"
            )
    t_ok = sum(abs(got / want - 1.0) <= 0.25 for got, want in times.values())
    # the models behind the numbers, per GPU type (item 4 of docs/simulator.md's validation)
    models = [f"Unit: {Prediction.UNIT}; each row's own batch and shape."]
    for gpu, (eff, comps) in fits.items():
        if comps:
            topo = row_topology(comps[0].row, cross_links, presets)
            compute = (presets or PRESETS)[gpu].compute_model(eff)
            models.append(
                f"{gpu}: links {describe_links(topo)} (at {topo.num_nodes}x{topo.ranks_per_node}); "
                f"compute {describe_compute(compute)}."
            )
    head = [
        f"Cross links: {cross_links or PRESET_LINKS}; "
        f"causal: {causal}; ring and charm replayed as {baselines_text(baselines)}.",
        "",
        (
            f"Rows: {rows}. Efficiency (fraction of Table 2 TFLOPS; the presets', not fitted): "
            if rows
            else "Efficiency (fraction of Table 2 TFLOPS; fitted unless the paper gives it: "
            + (", ".join(sorted(PAPER_EFFICIENCY)) if baselines == "paper" else "none")
            + "): "
        )
        + ", ".join(f"{g} {e:.3f}" for g, (e, _) in fits.items())
        + f". Within +-25%: {n_ok} of {n}."
        + (
            f" {'Times' if rows else 'Table 5 times'} within +-25%: {t_ok} of {len(times)} "
            "(ring's and each method's; Table 4's rows aside, whose batch and heads are assumed)."
            if times
            else ""
        ),
        "",
        *(f"* {m}" for m in models),
        "",
    ]
    return "\n".join(head + lines)


def parse_set(spec: str) -> tuple[str, str, float]:
    """``"GPU.FIELD=VALUE"`` -> ``(GPU, FIELD, VALUE)``, checked: GPU a preset, FIELD a numeric
    or boolean :class:`Hardware` field or ``enqueue_us``, VALUE a finite number >= 0 (an ``int``
    for a whole-number field, 0 or 1 for a boolean one)."""
    types = ("float", "int", "bool", float, int, bool)
    numeric = {f.name for f in dataclasses.fields(Hardware) if f.type in types} | {"enqueue_us"}
    key, _, value = spec.partition("=")
    gpu, _, name = key.partition(".")
    if gpu not in PRESETS or name not in numeric:
        raise ValueError(
            f"--set {spec!r}: write GPU.FIELD=VALUE with GPU in {sorted(PRESETS)} and FIELD "
            f"a numeric preset field ({', '.join(sorted(numeric))})"
        )
    if isinstance(getattr(PRESETS[gpu], name, 0.0), bool):
        if value not in ("0", "1"):
            raise ValueError(f"--set {spec!r}: {name} is a yes/no field: write 0 or 1")
        return gpu, name, value == "1"
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"--set {spec!r}: VALUE must be a finite number >= 0")
    if isinstance(getattr(PRESETS[gpu], name, 0.0), int):
        if number != int(number):
            raise ValueError(f"--set {spec!r}: {name} is a whole number")
        return gpu, name, int(number)
    return gpu, name, number


def set_fields(specs: list[str]) -> dict[str, Hardware]:
    """:data:`PRESETS` with each ``GPU.FIELD=VALUE`` of ``specs`` applied (:func:`parse_set`;
    ``enqueue_us``: the host's enqueue microseconds for every kind of operation)."""
    presets = dict(PRESETS)
    for gpu, name, number in map(parse_set, specs):
        if name == "enqueue_us":
            e = number * 1e-6
            field: dict = {"enqueue": Enqueue.per_operation(e)}
        else:
            field = {name: number}
        presets[gpu] = dataclasses.replace(presets[gpu], **field)
    return presets


#: The presets' links as the table header states them.
PRESET_LINKS = (
    f"presets (L20: one shared NUMA link; H20: {PRESETS['H20'].nics_per_node}/node, its fixed "
    f"cost per transfer on the link; H100: {PRESETS['H100'].nics_per_node}/node; TASP's "
    f"all-to-all on H100: one NIC per GPU at {PRESETS['H100'].a2a_rate:.2f} of Table 2's rate)"
)


def baselines_text(baselines: str) -> str:
    """How ``baselines`` replays ring and charm, for the tables."""
    if baselines == "paper":
        return (
            "the paper ran them (ring's forward without overlap; charm and rm+ wait at the end of "
            "every merge level; charm is Algorithm 2: every q crosses once, one step a source "
            "node, the first with the node's own q, float32 returns on "
            "two nodes, input-precision ones on more; q, out (in the returns' precision), dout, "
            "lse in the backward)"
        )
    return "our planner runs them"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cross-links", help="override the presets: rails, shared or nics:K")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--gpus", default="L20,H20,H100", help="GPU types to fit")
    ap.add_argument(
        "--baselines",
        choices=BASELINES,
        default="paper",
        help="replay ring and charm as the paper ran them (default) or as ours run",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="GPU.FIELD=VALUE",
        help="replay with one preset field changed (repeatable), e.g. H100.efficiency=0.35",
    )
    ap.add_argument(
        "--rows",
        metavar="FILE.csv",
        help="compare these measured rows (columns: "
        + ",".join(ROW_COLUMNS)
        + "; optional: "
        + ",".join(CCR_COLUMNS)
        + ") instead of Tables 4 and 5, at the presets' efficiencies",
    )
    ap.add_argument("--out", help="append the Markdown table to this file")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        presets = set_fields(args.set) if args.set else None
        # a set efficiency is used as given, not fitted
        given = {gpu for gpu, name, _ in map(parse_set, args.set) if name == "efficiency"}
    except ValueError as err:
        ap.error(str(err))
    if args.rows:
        try:
            rows = load_rows(args.rows)
        except (OSError, ValueError) as err:
            ap.error(str(err))
        gpus = sorted({r.gpu for r in rows})
        efficiency = {g: (presets or PRESETS)[g].efficiency for g in gpus}  # nothing fitted
    else:
        rows, gpus = PAPER_ROWS, args.gpus.split(",")
        efficiency = {g: presets[g].efficiency for g in gpus if presets and g in given}
    try:  # a set field the rows' layouts refuse (a link count that does not divide a node)
        fits = {
            g: fit_efficiency(
                g,
                args.cross_links,
                args.causal,
                baselines=args.baselines,
                presets=presets,
                efficiency=efficiency.get(g),
                rows=rows,
            )
            for g in gpus
        }
    except ValueError as err:
        ap.error(str(err))
    text = markdown(fits, args.cross_links, args.causal, args.baselines, args.rows, presets)
    ccr_comps = [
        c
        for r in rows
        if r.gpu in fits
        for c in compare_ccr(r, fits[r.gpu][0], args.cross_links, args.causal, presets)
    ]
    if ccr_comps:
        text += "\n\n" + ccr_markdown(ccr_comps)
    if args.set:
        text = (
            f"Preset fields set (a set efficiency is not fitted): {', '.join(args.set)}.\n\n" + text
        )
    print(text)
    print(f"\n({time.time() - t0:.1f} s)")
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
