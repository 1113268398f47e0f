"""``calibrate --repeat``: several runs of the measurements, combined into one set of samples.

Note [Repeated calibrations]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A host's speed can move between calibrations (on the CPU testbed one of four calibrations within
15 minutes timed its blocks 25% slow, docs/results/calibrated-2x2.md). ``calibrate --repeat N``
runs the measurements ``N`` times in one process group and combines the runs
(``--combine``):

* ``median-run`` (the default): the median run by its largest block's forward time (of an even
  count, the faster of the middle two: a disturbance only slows a run), fitted alone
  (:func:`pick_repeat`).
* ``pool`` (since 2026-12-06): every timing is the median of the runs' timings of the same thing
  (:func:`pool_runs`), and the profile is fitted once, on those medians. A calibration's fit
  has terms that trade against each other (a block's FLOP rate and its cost per element, the
  host's cost per pass and per exchange), and single timings spread: within one ``--repeat 3``
  calibration on the testbed (2026-12-06 05:38 UTC) one block size's three timings lay up to
  35% from their median, and the runs' fits predicted charm's backward at 1.53, 1.49 and
  1.31 s. The median of each timing keeps one disturbed timing from moving the fit.

Which predicts better was measured on the testbed (docs/results/calibrated-2x2.md, "Repeated
calibrations"): four ``--repeat 3`` calibrations, each around a sweep of 196 times, and the pool
predicted 140, 147, 162 and 188 of them within +-20% where the median run predicted 138, 158,
165 and 185. There the runs differ as a whole more than their timings do one by one: in the
six runs of the two calibrations around one sweep (06:13 and 06:36 UTC) the largest block
alone took 110-144 ms and ring's blocks inside a forward pass 22-28 ms of CPU, mostly slow or
fast in the same runs. The blocks' factor in a pass (Note [Blocks in a pass]) is the ratio of
the two, so a median run keeps a matched pair where the pool can take the blocks from one run
and the passes from another. So the default stays the median run.

Either way each run's own fit predicts ring's and charm's forward and backward at the
calibration's own layout and largest block, and the largest relative difference of any run's
prediction from the profile's joins ``fit_error`` as ``repeat`` (what a prediction moves by from
one calibration to the next, where a raw timing's noise may not matter at all). ``calibrate``
warns at :data:`REPEAT_WARN` or more. On the testbed the eleven profiles of 2026-12-06 predicted
that day's five sweeps (docs/results/calibrated-2x2.md, "Quiet profiles against the day's
sweeps"): those with a ``repeat`` of 4-5% put 174-195 of each sweep's 196 times within +-20%, the
one at 11% 162-185, and those at 21-25% 85-190, three of the four far worse than the rest (two
of those three fitted the slowest rank's block timings, the rule until that morning).

Note [A calibration's drift]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One run takes minutes, and the host's speed can move within them as it does between runs. Each
run times its largest block once more at its end, alone and as it timed it first
(``kernel_again``; every rank in turn on one host). :func:`speed_drift` compares the two, forward
and backward: ``max(a / b, b / a) - 1`` of the larger. It joins ``fit_error`` as ``drift``, so the
profile's known error and ``advise``'s ``fits:`` line (which replays the blocks that much faster
and slower, Note [What a fit's error moves]) count it, and ``calibrate`` warns at
:data:`DRIFT_WARN` or more: the machine did not hold still while it was measured, and
predictions from the profile can be off by as much. A run that drifts little can still sit in a
slow or fast hour; only runs at other times (``--repeat``, or a calibration next to the runs it
predicts) show that. With ``--repeat`` the profile's ``drift`` is the largest of its runs', and
``provenance.repeats`` lists each run's.
"""

from __future__ import annotations

import statistics

#: How ``calibrate --repeat`` combines its runs (Note [Repeated calibrations]).
COMBINE = ("pool", "median-run")

#: Keys of a raw file that label its measurement rather than hold samples (the later runs of
#: ``--repeat`` sit under ``"repeats"``).
RUN_LABELS = ("date", "host", "command", "launcher", "repeats")


def split_runs(raw: dict, labels: bool = True) -> list[dict]:
    """Every run of a raw file (rank 0's samples, later runs under ``"repeats"``), without
    ``"repeats"``; each with the file's labels (date, host, command, launcher) where ``labels``,
    else its samples alone."""
    keep = {k: raw[k] for k in RUN_LABELS if labels and k in raw and k != "repeats"}
    runs = [raw, *raw.get("repeats", [])]
    return [{**{k: v for k, v in r.items() if k not in RUN_LABELS}, **keep} for r in runs]


#: ``fit_error["drift"]`` at which ``calibrate`` warns (Note [A calibration's drift]).
DRIFT_WARN = 0.10

#: ``fit_error["repeat"]`` at which ``calibrate`` warns (Note [Repeated calibrations]).
REPEAT_WARN = 0.10


def speed_drift(raw: dict) -> float | None:
    """How far the largest block's time moved within one run (``raw``: its samples): ``max(a / b,
    b / a) - 1`` of its forward and backward timings at the run's start (``kernel``) and end
    (``kernel_again``), the larger; ``None`` for samples taken before 2026-12-06, which have no
    second timing (Note [A calibration's drift])."""
    again = raw.get("kernel_again")
    if not again:
        return None
    shape = (again["tokens"], again["heads"])
    first = [k for k in raw["kernel"] if (k["tokens"], k["heads"]) == shape]
    if len(first) != 1:
        raise ValueError(
            f"kernel_again times a block of {again['tokens']} tokens and {again['heads']} heads "
            "that the samples' kernel timings do not hold once; rerun megatron-charm-sim calibrate"
        )
    return max(
        max(again[t] / first[0][t], first[0][t] / again[t]) - 1.0 for t in ("fwd_s", "bwd_s")
    )


def unsteady(fit_error: dict[str, float]) -> list[str]:
    """Why a profile with these fit errors may not describe its machine: each sign that the
    machine's speed moved while it was calibrated (``drift`` of :data:`DRIFT_WARN` or more, Note
    [A calibration's drift]; ``repeat`` of :data:`REPEAT_WARN` or more, Note [Repeated
    calibrations]), as a clause; none where it held still."""
    out = []
    drift = fit_error.get("drift")
    if drift is not None and drift >= DRIFT_WARN:
        out.append(
            f"the largest block's time moved by {drift:.0%} between the start and the end of a "
            "run: the machine's speed moved while it was measured"
        )
    repeat = fit_error.get("repeat")
    if repeat is not None and repeat >= REPEAT_WARN:
        out.append(
            f"the runs' own profiles predict up to {repeat:.0%} apart: the machine's speed moved "
            "between the runs"
        )
    return out


#: Integer samples that each run chooses from its own timings, so runs may differ in them: the
#: messages streamed while the blocks are timed under traffic (sized from the run's link).
CHOSEN_COUNTS = ("messages",)


def repeat_times(raw: dict) -> dict[str, float]:
    """A run's times that ``calibrate --repeat`` reports: its largest block's forward and
    backward, and its largest intra- and cross-node transfer (where measured)."""
    block = max(raw["kernel"], key=lambda k: (k["tokens"], k["heads"]))
    times = {"block_fwd_s": block["fwd_s"], "block_bwd_s": block["bwd_s"]}
    for cls in ("intra", "cross"):
        samples = raw.get("p2p", {}).get(cls) or []
        if samples:
            times[f"{cls}_s"] = max(samples, key=lambda x: x["bytes"])["s"]
    return times


def pick_repeat(runs: list[dict]) -> int:
    """Which of ``runs`` (raw samples of one cluster, calibrated one after another) the
    ``median-run`` combination keeps: the index of the median run by its largest block's forward
    time; of an even count, the faster of the middle two."""
    if not runs:
        raise ValueError("no calibration runs to pick from")
    fwd = [repeat_times(r)["block_fwd_s"] for r in runs]
    return sorted(range(len(runs)), key=fwd.__getitem__)[(len(runs) - 1) // 2]


def repeat_summary(runs: list[dict], keep: int | None) -> list[dict]:
    """Per run of ``calibrate --repeat``: its reported times and, where one run is kept
    (``keep``; ``None`` when the runs are pooled), whether it is that one."""
    return [
        {**({} if keep is None else {"kept": i == keep}), **repeat_times(r)}
        for i, r in enumerate(runs)
    ]


def _pool(values: list, where: str) -> object:
    first = values[0]
    if isinstance(first, dict):
        keys = list(first)
        if any(list(v) != keys for v in values):
            raise ValueError(f"calibration runs differ in the fields of {where or 'the samples'}")
        return {k: _pool([v[k] for v in values], f"{where}.{k}".lstrip(".")) for k in keys}
    if isinstance(first, list):
        if where.endswith("rounds"):  # rounds of one timing: all of them count
            return [x for v in values for x in v]
        if any(len(v) != len(first) for v in values):
            raise ValueError(f"calibration runs differ in the number of {where} samples")
        return [
            _pool(list(items), f"{where}[{i}]") for i, items in enumerate(zip(*values, strict=True))
        ]
    if isinstance(first, float):
        return statistics.median(values)
    if all(v == first for v in values):  # sizes, names, flags: what was measured
        return first
    if where.rsplit(".", 1)[-1] in CHOSEN_COUNTS:
        return statistics.median_low(values)
    raise ValueError(f"calibration runs measured different {where}: {values}")


def pool_runs(runs: list[dict]) -> dict:
    """One set of raw samples from ``runs`` (each as
    :func:`~megatron_charm.sim.calibrate_worker.run` returns one, without ``"repeats"``): every
    timing (a float) the median of the runs' timings at the same place, every size, name and flag
    the runs' own (``ValueError`` where they differ: the runs measured different things), a
    count of :data:`CHOSEN_COUNTS` the runs' median one.
    The rounds of a blocks-in-a-pass sample are pooled, and its ``cpu_s`` is their median."""
    if not runs:
        raise ValueError("no calibration runs to pool")
    pooled = _pool(list(runs), "")
    assert isinstance(pooled, dict)
    for sample in pooled.get("blocks_in_passes") or []:
        if sample.get("rounds"):
            sample["cpu_s"] = statistics.median(sample["rounds"])
    return pooled
