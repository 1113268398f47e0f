"""How much a preset's assumed host and intra-node link costs move a recommendation.

Note [Enqueue sensitivity]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A preset's host enqueue cost (20 us per device operation, Note [Enqueue ahead] in
:mod:`megatron_charm.sim.engine`) is an assumption, not a measurement of any GPU. On problems
of Table 5's size (H100 passes of 31-561 ms) it does not show; on small ones the host's
enqueueing is most of a pass, and there the assumption, not the links or the kernels, decides
which method leads. The error that ``advise`` quotes (the preset's miss on the paper's rows)
does not cover that. So where the host's enqueueing is a large part of the compared methods'
time, ``advise`` (and ``auto``'s logged choice) replays the two leading methods again with no
enqueue cost and with twice the preset's, and, where either moves their margin out of the range
it quotes, says what each gives::

    host: enqueueing takes the host 96% of charm's forward+backward and 39% of ring's at 20 us
      per operation (assumed, not measured on a GPU); at 0 us charm leads ring 2.37x, at 40 us
      ring leads charm 1.09x: measure it (`megatron-charm-sim calibrate --device cuda`) and use
      that profile before trusting this margin

(H100 preset, 2 x 8, batch 1, 3,360 tokens, 12 heads of 192, where ``advise`` quotes charm's
margin as 1.74x, 1.45-2.08x within the preset's error.)

A preset's fixed cost per intra-node transfer is the paper's runs', not the user's cluster's:
H100's 40 us is fitted on one statement of the paper's text (Note [H100's NVLink fixed cost] in
:mod:`megatron_charm.sim.topology`), H20's 196 us comes from its ring rows. Where the schedules'
merge levels wait for many small NVLink transfers, it decides margins the same way, and the
same rule applies: the two leading methods are replayed with :data:`NCCL_INTRA_LAT` (what NCCL
alone takes) and with twice the preset's, and where either moves the margin out of the quoted
range, ``advise`` says what each gives::

    links: the preset's 40 us per intra-node transfer is the paper's runs', not measured on
      this cluster; at 5 us charm leads ring 1.75x, at 80 us charm leads ring 1.28x: measure it
      (`megatron-charm-sim calibrate`) and use that profile before trusting this margin

(the same example: the margin of 1.74x leaves its range at 80 us.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron_charm.sim.compute import ComputeModel, Enqueue
from megatron_charm.sim.predict import SIMPLICITY, MethodPrediction, Prediction, margin_range
from megatron_charm.sim.profile import Profile
from megatron_charm.sim.topology import ASSUMED_INTRA_LAT, Topology

#: Host share of a method's forward+backward (its enqueue time over its time) from which the
#: enqueue assumption is replayed at 0 and twice the preset's cost.
HOST_SHARE = 0.25

#: The factors of the assumed enqueue cost that the note replays.
FACTORS = (0.0, 2.0)

#: Seconds per intra-node transfer that the links note replays besides twice the preset's: what
#: the presets assume where the paper says nothing, about NCCL's own cost.
NCCL_INTRA_LAT = ASSUMED_INTRA_LAT


def assumes_preset_costs(profile: Profile | None) -> bool:
    """Whether ``profile``'s host enqueue cost and fixed cost per intra-node transfer are a
    preset's (this package's assumption or the paper's runs') rather than a measurement (a
    calibrated profile's) or the user's own numbers."""
    return profile is not None and profile.preset_error is not None


def host_share(mp: MethodPrediction) -> float:
    """Seconds the host takes to enqueue ``mp``'s forward and backward (the slowest rank's each),
    over ``mp``'s forward+backward time."""
    return (mp.forward.enqueued_max + mp.backward.enqueued_max) / mp.total


def _amount(enqueue: Enqueue, per_operation: bool = False) -> str:
    costs = [getattr(enqueue, f.name) * 1e6 for f in dataclasses.fields(Enqueue)]
    if len(set(costs)) == 1:
        return f"{costs[0]:g} us" + (" per operation" if per_operation else "")
    return "call/exchange/kernel/merge " + "/".join(f"{c:g}" for c in costs) + " us"


def _lead(pred: Prediction, pair: tuple[str, str]) -> str:
    fast, slow = sorted(pair, key=lambda m: pred.methods[m].total)
    return f"{fast} leads {slow} {pred.methods[slow].total / pred.methods[fast].total:.2f}x"


def enqueue_note(
    pred: Prediction,
    choice: str,
    compute: ComputeModel,
    repredict: Callable[[ComputeModel, tuple[str, ...]], Prediction],
    candidates: tuple[str, ...] = SIMPLICITY,
    error: float = 0.0,
) -> str | None:
    """The sentence of Note [Enqueue sensitivity] for ``choice`` and the fastest other method of
    ``candidates`` in ``pred`` (replayed with ``compute``, whose enqueue cost is an assumption),
    or ``None`` where the host's enqueueing is under :data:`HOST_SHARE` of both methods' time or
    where neither replay moves the margin out of the range that ``error`` (the model's known
    relative error, as ``advise`` quotes it) gives. ``repredict(compute, methods)`` replays
    ``methods`` as ``pred`` was, with another ``compute``."""
    enqueue = compute.enqueue_cost()
    pair = _pair(pred, choice, candidates)
    settable = dataclasses.is_dataclass(compute) and any(
        f.name == "enqueue" for f in dataclasses.fields(compute)
    )
    if not enqueue.any or pair is None or not settable:
        return None
    runner_up = pair[1]
    shares = {m: host_share(pred.methods[m]) for m in pair}
    if max(shares.values()) < HOST_SHARE:
        return None
    replays = []
    for factor in FACTORS:
        other = enqueue.times(factor)
        alt = repredict(dataclasses.replace(compute, enqueue=other), pair)  # type: ignore[type-var]
        replays.append((_amount(other), alt))
    leads = _leads_if_moved(pred, pair, error, replays)
    if leads is None:
        return None
    assumed = _amount(enqueue, per_operation=True)
    return (
        f"host: enqueueing takes the host {shares[choice]:.0%} of {choice}'s forward+backward "
        f"and {shares[runner_up]:.0%} of {runner_up}'s at {assumed} (assumed, not measured on a "
        f"GPU); {leads}: measure it (`megatron-charm-sim calibrate --device cuda`) "
        "and use that profile before trusting this margin"
    )


def _leads_if_moved(
    pred: Prediction,
    pair: tuple[str, str],
    error: float,
    replays: list[tuple[str, Prediction]],
) -> str | None:
    """``"at LABEL a leads b Nx, ..."`` for each ``(label, replayed prediction)``, or ``None``
    where no replay moves the margin of ``pair`` (the choice, then its runner-up) out of the
    range that ``error`` gives around ``pred``'s."""

    def margin(p: Prediction) -> float:
        return p.methods[pair[1]].total / p.methods[pair[0]].total

    lo, hi = margin_range(margin(pred), error)
    if all(lo <= margin(alt) <= hi for _, alt in replays):
        return None
    return ", ".join(f"at {label} {_lead(alt, pair)}" for label, alt in replays)


def _pair(pred: Prediction, choice: str, candidates: tuple[str, ...]) -> tuple[str, str] | None:
    """``choice`` and the fastest other method of ``candidates`` in ``pred``; ``None`` if none."""
    others = [m for m in pred.methods if m in candidates and m != choice]
    if not others:
        return None
    return choice, min(others, key=lambda m: pred.methods[m].total)


def intra_lat_note(
    pred: Prediction,
    choice: str,
    topo: Topology,
    repredict: Callable[[Topology, tuple[str, ...]], Prediction],
    candidates: tuple[str, ...] = SIMPLICITY,
    error: float = 0.0,
) -> str | None:
    """The links sentence of Note [Enqueue sensitivity] for ``choice`` and the fastest other
    method of ``candidates`` in ``pred``, replayed on ``topo`` (whose fixed cost per intra-node
    transfer is a preset's), or ``None`` where that cost is at most :data:`NCCL_INTRA_LAT` or
    where neither replay (at :data:`NCCL_INTRA_LAT` and at twice the preset's) moves the margin
    out of the range that ``error`` gives. ``repredict(topo, methods)`` replays ``methods`` as
    ``pred`` was, on another ``topo``."""
    pair = _pair(pred, choice, candidates)
    if pair is None or topo.intra_lat <= NCCL_INTRA_LAT:
        return None
    lats = (NCCL_INTRA_LAT, 2 * topo.intra_lat)
    leads = _leads_if_moved(
        pred,
        pair,
        error,
        [
            (f"{x * 1e6:g} us", repredict(dataclasses.replace(topo, intra_lat=x), pair))
            for x in lats
        ],
    )
    if leads is None:
        return None
    return (
        f"links: the preset's {topo.intra_lat * 1e6:g} us per intra-node transfer is the paper's "
        f"runs', not measured on this cluster; {leads}: measure it (`megatron-charm-sim "
        "calibrate`) and use that profile before trusting this margin"
    )
