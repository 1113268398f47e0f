"""``method="auto"`` / ``--cp-comm-type auto``: the CP method per layer shape, from the simulator.

Note [Choosing a method]
~~~~~~~~~~~~~~~~~~~~~~~~
The choice is a pure function of data that every rank holds alike::

    profile (links, compute)  --+
    layout (m nodes x p ranks) -+-> simulate every candidate's    --> fastest fwd+bwd;
    CP groups sharing a node  --+   real plans                        ties (2%) go to
    shape (b, s_local, h, h_kv, d, dtype), causal                      the simpler method
    plan options (window, cross_return, ...)

The candidates are the zigzag methods that can split the shape (``a2a`` only when the heads
divide over the CP group); masks are not simulated, so the choice is made for the dense shape.
The CP groups sharing a node (tensor-parallel ranks and data-parallel replicas, counted by
:meth:`megatron_charm.comm.topology.CPTopology.build`) share its links that are not one per GPU
(Note [Groups sharing a node] in :mod:`megatron_charm.sim.node_groups`).
It runs once per new shape and is cached; on CP groups of 64+ ranks the replay takes seconds
(``bench planning``). With a preset as the profile, a shape whose time the host's assumed
enqueue cost dominates replays its two leading methods twice more (Note [Enqueue sensitivity]
in :mod:`megatron_charm.sim.sensitivity`), about a second each on 128 ranks. Every rank
computes it, so a rank whose profile differs may pick another method: the plan-option agreement
that every call runs then stops the job with both values, instead of letting ranks run
different schedules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_charm.plan import methods_for
from megatron_charm.plan.options import PlanOptions
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Layout
from megatron_charm.sim.profile import Profile, load_profile

if TYPE_CHECKING:
    from megatron_charm.sim.compute import ComputeModel
    from megatron_charm.sim.predict import Prediction
    from megatron_charm.sim.topology import Topology

log = logging.getLogger("megatron_charm")

AUTO = "auto"


@dataclass(frozen=True)
class AutoChoice:
    """The method ``auto`` picked for one shape, and why."""

    method: str
    predicted_s: dict[str, float]
    """Predicted forward + backward seconds of every candidate."""
    profile: str
    """The profile's name."""
    reasons: tuple[str, ...]
    groups_per_node: int = 1
    """CP groups counted as sharing each node's links (Note [Groups sharing a node])."""

    @property
    def margin(self) -> float:
        """Predicted time of the fastest other candidate over the chosen one's (``inf`` if none)."""
        others = [t for m, t in self.predicted_s.items() if m != self.method]
        return min(others) / self.predicted_s[self.method] if others else float("inf")

    def describe(self) -> str:
        times = ", ".join(f"{m} {t * 1e3:.3g} ms" for m, t in sorted(self.predicted_s.items()))
        if self.margin >= 1.0:
            why = f"predicted {self.margin:.2f}x faster than the next method"
        else:  # a tie within advise's 2% goes to the simpler method
            why = f"within {1 / self.margin - 1:.1%} of the fastest and simpler"
        shared = f", {self.groups_per_node} CP groups per node" if self.groups_per_node > 1 else ""
        return (
            f"cp method auto -> {self.method} ({why}; profile {self.profile}{shared}; fwd+bwd "
            f"{times})"
        )


_CACHE: dict[tuple, tuple[object, AutoChoice]] = {}

#: The largest CP group whose every rank the choice replays; larger ones replay one node
#: (Note [Node symmetry] in :mod:`megatron_charm.sim.programs`). Every rank pays the replay at
#: its first call: on 16 x 8 the six candidates in full take about 15 s a shape on a 2-core
#: machine, one node 1.2 s (1.6 s with the preset's two sensitivity replays; 2026-12-07). The
#: CLI replays in full up to 128 ranks, where the user waits for an exact answer.
RUNTIME_FULL_MAX_RANKS = 64
_WARNED: set[tuple[str, object]] = set()


def _warn_once(key: tuple[str, object], message: str) -> None:
    """Log ``message`` as a WARNING the first time ``key`` (a profile's name and what is wrong
    with it) comes up in this process: ``auto`` runs once per new shape."""
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("megatron-charm: cp method auto: %s", message)


def _other_host(theirs: dict, ours: dict) -> list[str]:
    """What differs between the host a profile was calibrated on and this rank's, as
    ``"key: THEIRS vs OURS"``: a GPU profile describes its GPU alone; a CPU profile (no GPU, the
    testbed's) describes the CPU model, its instruction sets and its cores, and no GPU."""
    from megatron_charm.bench.provenance import host_differences

    if theirs.get("gpu") or ours.get("gpu"):
        mine, yours = theirs.get("gpu"), ours.get("gpu")
        if mine == yours:
            return []
        return [f"gpu: {mine or 'none (CPU ranks)'} vs {yours or 'none (CPU ranks)'}"]
    return host_differences(theirs, ours, keys=("cpu", "isa", "cores"))


def _warn_other_host(prof: Profile) -> None:
    """Log once per profile and difference when ``prof`` was calibrated on another host than
    this rank runs on: another GPU, or for a CPU profile another CPU model, instruction sets or
    number of cores (an AMD EPYC profile of 2026-12-06 put 87 of 196 times of the same
    testbed's sweep on an Intel Xeon with AMX within +-20%, its charm 41% too slow in the
    median; a profile calibrated on that Xeon put 181 of them; results/calibrated-2x2.md, "A
    third host"). Profiles that record no host (calibrated before 2026-12-04) and presets are
    not checked."""
    from megatron_charm.bench.provenance import host

    theirs = prof.provenance.get("host")
    if not isinstance(theirs, dict) or not prof.measured:  # "not recorded", or a preset
        return
    diff = _other_host(theirs, host())
    if diff:
        _warn_once(
            (prof.name, tuple(diff)),
            f"profile {prof.name!r} was calibrated on another host ({'; '.join(diff)}); its "
            "predictions describe that one. Run `megatron-charm-sim calibrate` on this cluster "
            "(`--launcher env --device cuda` on GPUs) and pass its profile",
        )


def _warn_unsteady(prof: Profile) -> None:
    """Log once per profile when the machine's speed moved while ``prof`` was calibrated (Note
    [A calibration's drift], Note [Repeated calibrations]): its choices can be off by as much."""
    from megatron_charm.sim.repeats import unsteady

    reasons = unsteady(prof.fit_error) if prof.measured else []
    if reasons:
        _warn_once(
            (prof.name, "unsteady"),
            f"profile {prof.name!r}: {'; '.join(reasons)}; its choices can be off by as much. "
            "Run `megatron-charm-sim calibrate --repeat 3` again when the cluster is quiet",
        )


def choose_method(
    profile: Profile | str,
    layout: Layout,
    shape: AttnShape,
    causal: bool,
    options: PlanOptions | None = None,
    groups_per_node: int = 1,
) -> AutoChoice:
    """The method with the lowest predicted forward + backward time for this layer shape.

    Args:
        profile: a :class:`megatron_charm.sim.profile.Profile`, a preset name or a profile path
            (read once: a path's choices are cached by the path).
        layout: the CP group's ``m x p`` layout.
        shape: the per-rank shape: ``b``, ``s_local``, ``h``, ``h_kv``, ``d``, input ``itemsize``.
        causal: causal attention (zigzag layout).
        options: the other plan options (their method is replaced per candidate).
        groups_per_node: CP groups whose ranks share each node (tensor-parallel ranks and
            data-parallel replicas): the profile's links that are not one per GPU are shared
            by that many groups (Note [Groups sharing a node] in
            :mod:`megatron_charm.sim.node_groups`).
    """
    from megatron_charm.sim.node_groups import shared_by
    from megatron_charm.sim.predict import SIMPLICITY, Problem, advise, predict
    from megatron_charm.sim.sensitivity import assumes_preset_costs, enqueue_note, intra_lat_note

    options = options or PlanOptions()
    # A path or preset is its own key; a Profile object is keyed by identity (the cache holds
    # it, so the id is not reused), which keeps the per-call lookup cheap.
    spec = profile if isinstance(profile, str) else ("profile object", id(profile))
    key = (spec, layout, shape, causal, options, groups_per_node)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit[1]
    prof = load_profile(profile)
    _warn_other_host(prof)
    _warn_unsteady(prof)
    m, p = layout.num_nodes, layout.ranks_per_node
    problem = Problem(
        shape.b, shape.s_local * m * p, shape.h, shape.d, shape.h_kv, causal, shape.itemsize
    )
    topo, compute = shared_by(prof.topology(m, p), groups_per_node), prof.compute_model()

    def replay(model: ComputeModel, links: Topology, names: tuple[str, ...] | None) -> Prediction:
        return predict(
            links, problem, model, names, options=options, full_max_ranks=RUNTIME_FULL_MAX_RANKS
        )

    # only what advise can pick (SIMPLICITY): replaying the baselines too cost 27 of 30 s on
    # 32 x 8 (causal ring-contig and a2a+charm have no node symmetry, so they replay every rank)
    candidates = tuple(m for m in methods_for(layout, shape) if m in SIMPLICITY)
    pred = replay(compute, topo, candidates)
    adv = advise(pred)
    # Note [Enqueue sensitivity]: a preset's host cost and fixed cost per intra-node transfer
    # are the paper's runs', not this cluster's; say where they decide
    notes: list[str] = []
    if assumes_preset_costs(prof):
        error = prof.preset_error or 0.0
        found = (
            enqueue_note(pred, adv.method, compute, lambda c, n: replay(c, topo, n), error=error),
            intra_lat_note(pred, adv.method, topo, lambda t, n: replay(compute, t, n), error=error),
        )
        notes = [n for n in found if n]
    totals = {name: mp.total for name, mp in pred.methods.items()}
    choice = AutoChoice(adv.method, totals, prof.name, (*adv.reasons, *notes), groups_per_node)
    _CACHE[key] = (profile, choice)
    log.info("megatron-charm: %s", choice.describe())
    for note in notes:
        log.warning("megatron-charm: cp method auto -> %s: %s", adv.method, note)
    return choice
