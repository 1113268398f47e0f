"""A pass's edges per rank, measured and replayed side by side (``testbed --measured``).

Note [Edges of a pass]
~~~~~~~~~~~~~~~~~~~~~~
A replay can match a pass's time and still run it in another order, and a miss is easier to
read from where each rank's pass turns than from two timelines of hundreds of lines. Six edges
say most of it::

    call  first exchange   first block                 last arrival    end
     |----------|--------------|======  ....  ======  ...... |=== ... ===|
                               <--------- in blocks, waiting ---------->

* **first exchange**: the first exchange's posting (measured) or its first transfer's start
  (replayed: the replay starts a transfer when both ends have posted it, so this edge can only
  be later than the measured one);
* **first block**: the start of the first block;
* **in blocks** and **waiting**: seconds in blocks and merges, and in waits;
* **last arrival**: the end of the last wait, when the rank has all it receives;
* **end**: the call's return (measured, where recorded) or the rank's last instruction's end.

The measured side is one timed call of ``megatron-charm-bench attention --raw`` (the median
iteration, as ``megatron-charm-bench timeline`` prints it); the replayed side is the engine's
record of the same method on the same point (:func:`megatron_charm.sim.testbed.replay_timeline`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatron_charm.bench.summary import median_iteration, timelines
from megatron_charm.sim.engine import RankResult


@dataclass(frozen=True)
class RankEdges:
    """One rank's edges of one pass, seconds from the call's start (Note [Edges of a pass])."""

    cp_rank: int
    first_exchange: float | None
    """The first exchange posted (measured) or its first transfer started (replayed)."""
    first_block: float | None
    in_blocks: float
    """Seconds in blocks and merges."""
    waiting: float
    """Seconds in waits."""
    last_arrival: float | None
    """The end of the last wait."""
    end: float


def _edges(
    cp_rank: int,
    spans: Iterable[tuple[str, float, float]],
    exchanges: Iterable[float],
    end: float | None,
) -> RankEdges:
    """``spans``: ``(kind, start, end)`` with kind ``block``, ``wait`` or another (host work);
    ``exchanges``: the start of each exchange."""
    spans = list(spans)
    blocks = [(s, e) for k, s, e in spans if k == "block"]
    waits = [(s, e) for k, s, e in spans if k == "wait"]
    starts = list(exchanges)
    last = max((e for _, _, e in spans), default=0.0)
    return RankEdges(
        cp_rank=cp_rank,
        first_exchange=min(starts) if starts else None,
        first_block=min(s for s, _ in blocks) if blocks else None,
        in_blocks=sum(e - s for s, e in blocks),
        waiting=sum(e - s for s, e in waits),
        last_arrival=max(e for _, e in waits) if waits else None,
        end=last if end is None else end,
    )


def measured_edges(raw: dict, method: str, mode: str = "fwd") -> list[RankEdges]:
    """Every rank's edges of the median timed call of ``method`` in a ``--raw`` file.

    ``ValueError`` when the file has no trace of ``method`` (only our methods are traced)."""
    if method not in raw["ranks"][0]["recs"]:
        raise ValueError(
            f"--measured: the raw file has no run of {method!r} (it has "
            f"{', '.join(raw['ranks'][0]['recs'])}); pass the raw file of a run with that method"
        )
    it = median_iteration(raw, method, mode)
    out = []
    for tl in timelines(raw, method, mode, it):
        events = tl["events"]
        if not events:
            raise ValueError(f"--measured: no trace for {method!r}: only our methods are traced")
        kind = {"Compute": "block", "Merge": "block", "Wait": "wait"}
        spans = [(kind.get(k, k), s, e) for _, k, _, s, e in events]
        posts = [s for _, k, _, s, _ in events if k == "Exchange"]
        out.append(_edges(tl["cp_rank"], spans, posts, tl["wall"]))
    return out


def replayed_edges(ranks: Sequence[RankResult]) -> list[RankEdges]:
    """Every replayed rank's edges, from an engine record (``record=True``)."""
    kind = {"C": "block", "M": "block", "W": "wait"}
    return [
        _edges(
            r.cp_rank,
            ((kind.get(label.split(" ", 1)[0], "host"), s, e) for s, e, label in r.timeline),
            (s for s, _, _ in r.transfers),
            r.finish,
        )
        for r in ranks
    ]


def format_edges(measured: Sequence[RankEdges], replayed: Sequence[RankEdges]) -> str:
    """A Markdown table: each rank's edges, ``measured / replayed`` in ms.

    ``ValueError`` when the two sides have different ranks (another layout)."""
    if [m.cp_rank for m in measured] != [r.cp_rank for r in replayed]:
        raise ValueError(
            f"--measured: the raw file's ranks {[m.cp_rank for m in measured]} are not the "
            f"replay's {[r.cp_rank for r in replayed]}; pass the raw file of the same point"
        )

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    cols = ("first_exchange", "first_block", "in_blocks", "waiting", "last_arrival", "end")
    lines = [
        "| cp_rank | first exchange | first block | in blocks | waiting | last arrival | end |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in zip(measured, replayed, strict=True):
        cells = [f"{ms(getattr(m, c))} / {ms(getattr(r, c))}" for c in cols]
        lines.append(f"| {m.cp_rank} | " + " | ".join(cells) + " |")
    return (
        "ms from the call's start, measured / replayed (Note [Edges of a pass] in "
        "megatron_charm/sim/timeline_edges.py)\n\n" + "\n".join(lines) + "\n"
    )
