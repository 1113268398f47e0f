"""How much a preset's assumed host and intra-node link costs, and a measured profile's fit
errors, move a recommendation.

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

Note [What a fit's error moves]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A measured profile quotes its largest fit residual ``e`` and ``advise`` widens the margin by it
as if each method's time could be off by ``e`` on its own. That bound is safe and often
useless: on the CPU testbed the loopback fit misses one sample by 64% (its transfers take
microseconds of passes of hundreds of milliseconds), and a margin of 1.69x became 0.37x-7.75x.
A fit's error moves every method that uses what it prices, in the same direction. So for a
measured profile the two leading methods are also replayed with each fit's timings scaled by its
own worst miss, up and down in turn (blocks' forward or backward costs, one link's fixed cost and
time per byte, the host's work per pass, exchange and byte, the factor of blocks in a pass), and
``fits_note`` says where their
margin goes, the most any one fit moves it either way added up over the fits::

    fits: each fit replayed at its own worst miss (cross 8%, host_cpu 29%, intra 64%,
      kernel_bwd 8%, kernel_fwd 1%), charm's margin over a2a 1.69x stays within 1.65x-1.74x
      (the most: host_cpu); not covered: the replay's own error (a CPU testbed's sweep:
      docs/simulator.md (c))

(profile ``epyc-w`` of docs/results/calibrate/, 2 x 2, 2,048 tokens causal, 4 heads of 64:
the margin that the largest residual alone widens to 0.37x-7.75x.) It costs two replays of the
two leaders per fit, about three times a plain ``predict`` of a small group.

Residuals it cannot scale (``repeat``, a calibration's spread) are left to the wider range.
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
    lo, hi = margin_range(_margin(pred, pair), error)
    if all(lo <= _margin(alt, pair) <= hi for _, alt in replays):
        return None
    return ", ".join(f"at {label} {_lead(alt, pair)}" for label, alt in replays)


def _margin(pred: Prediction, pair: tuple[str, str]) -> float:
    """The runner-up's forward+backward time over the choice's (``pair``: choice, runner-up)."""
    return pred.methods[pair[1]].total / pred.methods[pair[0]].total


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


#: What each fit of a measured profile prices (Note [What a fit's error moves]): compute fields
#: scaled as time (a rate divides), link fields by their class (``intra`` or ``cross``).
_COMPUTE_FITS = {
    "kernel_fwd": ("fwd_overhead", "fwd_per_element", "/fwd_flops_per_s"),
    "kernel_bwd": ("bwd_overhead", "bwd_per_element", "/bwd_flops_per_s"),
    "host_cpu": (
        "host_call_s",
        "host_post_s",
        "host_byte_s",
        "host_element_fwd_s",
        "host_element_bwd_s",
        "transport_post_s",
        "transport_byte_s",
    ),
    # Note [Blocks in a pass]: one method's ratio lies this far from the pooled factor
    "blocks_in_pass": ("fwd_in_pass", "bwd_in_pass"),
    # Note [Transport in a pass]: one sample's ratio lies this far from the pooled factor
    "transport_in_pass": ("transport_in_pass",),
    # Note [A calibration's drift]: every block, as the host's speed moved during the run
    "drift": ("fwd_in_pass", "bwd_in_pass"),
}


def scaled_fit(
    key: str, factor: float, compute: ComputeModel, topo: Topology
) -> tuple[ComputeModel, Topology] | None:
    """``compute`` and ``topo`` with what fit ``key`` prices taking ``factor`` times as long, or
    ``None`` where this cannot scale it (an unknown key, or a compute model without those
    fields)."""
    if key in ("intra", "cross"):
        bw, lat = getattr(topo, f"{key}_bw"), getattr(topo, f"{key}_lat")
        links = dataclasses.replace(topo, **{f"{key}_bw": bw / factor, f"{key}_lat": lat * factor})
        return compute, links
    fields = _COMPUTE_FITS.get(key)
    if fields is None or not dataclasses.is_dataclass(compute):
        return None
    have = {f.name for f in dataclasses.fields(compute)}
    changes = {}
    for name in fields:
        rate = name.startswith("/")
        name = name.lstrip("/")
        if name not in have:
            return None
        value = getattr(compute, name)
        changes[name] = value / factor if rate else value * factor
    return dataclasses.replace(compute, **changes), topo  # type: ignore[type-var]


def fits_note(
    pred: Prediction,
    choice: str,
    compute: ComputeModel,
    topo: Topology,
    repredict: Callable[[ComputeModel, tuple[str, ...], Topology], Prediction],
    fit_error: dict[str, float],
    candidates: tuple[str, ...] = SIMPLICITY,
) -> str | None:
    """The sentence of Note [What a fit's error moves] for ``choice`` and the fastest other
    method of ``candidates`` in ``pred`` (replayed with ``compute`` on ``topo`` from a measured
    profile whose fits miss their samples by ``fit_error``), or ``None`` where there is no other
    method or no fit this can scale. ``repredict(compute, methods, topo)`` replays ``methods``
    as ``pred`` was, with another ``compute`` and ``topo``."""
    pair = _pair(pred, choice, candidates)
    if pair is None:
        return None
    base = _margin(pred, pair)
    down, up, moved = 1.0, 1.0, {}
    for key, err in sorted(fit_error.items()):
        scaled = [scaled_fit(key, f, compute, topo) for f in (1.0 + err, 1.0 / (1.0 + err))]
        if err <= 0 or None in scaled:
            continue
        ratios = [_margin(repredict(c, pair, t), pair) / base for c, t in scaled]  # type: ignore[misc]
        down *= min(1.0, *ratios)
        up *= max(1.0, *ratios)
        moved[key] = max(abs(r - 1.0) for r in ratios)
    if not moved:
        return None
    errors = ", ".join(f"{k} {fit_error[k]:.0%}" for k in moved)
    most = max(moved, key=lambda k: moved[k])
    return (
        f"fits: each fit replayed at its own worst miss ({errors}), {pair[0]}'s margin over "
        f"{pair[1]} {base:.2f}x stays within {base * down:.2f}x-{base * up:.2f}x (the most: "
        f"{most}); not covered: the replay's own error (a CPU testbed's sweep: "
        "docs/simulator.md (c))"
    )
