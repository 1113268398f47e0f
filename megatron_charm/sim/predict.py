"""Predictions for every method on one cluster and problem, CCR, and the ``advise`` rule."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from megatron_charm.plan import PlanOptions, check_shape, methods_for
from megatron_charm.plan.layout import block_parts
from megatron_charm.plan.payloads import AttnShape, payload_bytes
from megatron_charm.plan.types import Compute, Kind, Layout, Part, Payload, Wire
from megatron_charm.sim.compute import ComputeModel, describe_compute
from megatron_charm.sim.engine import PassResult, simulate_pass
from megatron_charm.sim.programs import FULL_MODE_MAX_RANKS, SYMMETRIC_ERROR, ProgramSet, programs
from megatron_charm.sim.topology import Topology

# Methods whose predicted fwd+bwd times are within this fraction count as a tie; ties go to the
# simplest method (ring and all_gather are stock Megatron/TE p2p and all_gather, then merge, rm+,
# charm).
TIE = 0.02
SIMPLICITY = ("ring", "all_gather", "a2a", "a2a+p2p", "merge", "rm+", "charm")


@dataclass(frozen=True)
class Problem:
    """One attention layer's problem as the user states it (global sequence)."""

    batch: int
    """Micro-batch size."""
    seq: int
    """Global sequence length (split over the CP group)."""
    heads: int
    """Query heads (per tensor-parallel rank)."""
    head_dim: int
    """Head dimension."""
    kv_heads: int | None = None
    """Key/value heads (GQA); ``None``: same as ``heads``."""
    causal: bool = False
    """Causal attention with the zigzag layout."""
    itemsize: int = 2
    """Bytes per element of q, k, v (2 for bf16/fp16)."""

    def shape(self, cp_size: int) -> AttnShape:
        """The per-rank :class:`AttnShape`; raises ``ValueError`` if ``seq`` does not split."""
        unit = 2 * cp_size if self.causal else cp_size
        if self.seq < 1 or self.seq % unit != 0:
            raise ValueError(
                f"--seq {self.seq} must be positive and divisible by {unit} "
                f"({'2 x ' if self.causal else ''}cp_size {cp_size}"
                f"{', zigzag halves' if self.causal else ''}); pick a multiple of {unit}"
            )
        kv = self.heads if self.kv_heads is None else self.kv_heads
        if min(self.batch, self.heads, self.head_dim, kv, self.itemsize) < 1 or self.heads % kv:
            raise ValueError(
                f"--batch {self.batch}, --heads {self.heads}, --kv-heads {kv} and --head-dim "
                f"{self.head_dim} must be positive, with the query heads divisible by the kv "
                "heads (grouped-query attention); change --heads or --kv-heads"
            )
        return AttnShape(
            self.batch, self.seq // cp_size, self.heads, kv, self.head_dim, self.itemsize
        )


@dataclass
class MethodPrediction:
    """Forward and backward replay of one method."""

    method: str
    forward: PassResult
    backward: PassResult

    @property
    def total(self) -> float:
        return self.forward.makespan + self.backward.makespan

    @property
    def exact(self) -> bool:
        """Whether both passes replayed every rank, or one node exactly (Note [Node symmetry])."""
        return self.forward.exact and self.backward.exact


@dataclass
class Prediction:
    """All methods on one topology and problem."""

    topo: Topology
    problem: Problem
    shape: AttnShape
    ccr_forward: float
    ccr_backward: float
    methods: dict[str, MethodPrediction] = field(default_factory=dict)
    compute: ComputeModel | None = None
    """The compute model the methods were replayed with."""
    ccr_seconds: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
    """``(T_comp, T_comm)`` of the forward's and the backward's CCR (:func:`ccr_parts`)."""
    ccr_nominal: tuple[tuple[float, float], tuple[float, float]] | None = None
    """The same two sums with ``T_comm`` at a preset's Table 2 bandwidth, as the paper's Eq. 9
    counts it (:func:`nominal_links`); ``None`` without a preset, or where its transfers run at
    Table 2's rate anyway."""

    #: What one predicted time covers.
    UNIT = "one attention layer, one micro-batch (its batch), forward and backward separately"

    def speedup(self, method: str, backward: bool = False) -> float:
        """Ring's time over ``method``'s time for one pass."""
        ring, other = self.methods["ring"], self.methods[method]
        if backward:
            return ring.backward.makespan / other.backward.makespan
        return ring.forward.makespan / other.forward.makespan

    def to_dict(self, error: float | None = None) -> dict:
        """The prediction as JSON-ready data; ``error``, if known, the hardware numbers' relative
        error per time, which gives every speedup its range (:func:`speedup_range`)."""
        out: dict = {
            "gpus": f"{self.topo.num_nodes}x{self.topo.ranks_per_node}",
            "topology": self.topo.__dict__,
            "problem": self.problem.__dict__,
            "s_local": self.shape.s_local,
            "ccr": {
                "forward": self.ccr_forward,
                "backward": self.ccr_backward,
                # the paper's appendix columns: ring's blocks and transfers one after the other
                "t_comp_ms": {
                    "forward": self.ccr_seconds[0][0] * 1e3,
                    "backward": self.ccr_seconds[1][0] * 1e3,
                },
                "t_comm_ms": {
                    "forward": self.ccr_seconds[0][1] * 1e3,
                    "backward": self.ccr_seconds[1][1] * 1e3,
                },
            },
            "unit": self.UNIT,
            "links": describe_links(self.topo),
            "methods": {},
        }
        if self.ccr_nominal is not None:
            fwd, bwd = self.ccr_nominal
            out["ccr"]["table2"] = {
                "forward": ccr_ratio(fwd),
                "backward": ccr_ratio(bwd),
                "t_comm_ms": {"forward": fwd[1] * 1e3, "backward": bwd[1] * 1e3},
            }
        if self.compute is not None:
            out["compute"] = {
                "kind": type(self.compute).__name__,
                "description": describe_compute(self.compute),
                **dataclasses.asdict(self.compute),
            }
        for name, mp in self.methods.items():
            entry = {}
            for tag, res in (("forward", mp.forward), ("backward", mp.backward)):
                entry[tag] = {
                    "time_ms": res.makespan * 1e3,
                    "exposed_ms_mean": res.exposed_mean * 1e3,
                    "exposed_ms_max": res.exposed_max * 1e3,
                    "compute_ms_mean": res.busy_mean * 1e3,
                    "idle_ms_mean": res.idle_mean * 1e3,
                    "host_enqueue_ms_max": res.enqueued_max * 1e3,
                    "bytes_per_link": res.link_bytes(),
                    "simulated_ranks": len(res.ranks),
                    "exact": res.exact,
                }
                if "ring" in self.methods:
                    entry[tag]["speedup_vs_ring"] = self.speedup(name, tag == "backward")
                    if error is not None and name != "ring":
                        lo, hi = speedup_range(self, name, tag == "backward", error)
                        entry[tag]["speedup_range_vs_ring"] = [lo, hi]
            # a one-node replay's known error against full replays (0: exact)
            entry["replay_error"] = replay_error(self, [name]).get(name, 0.0)
            out["methods"][name] = entry
        return out


def ccr_parts(
    topo: Topology, shape: AttnShape, compute: ComputeModel, causal: bool, backward: bool
) -> tuple[float, float]:
    """``(T_comp, T_comm)`` seconds of the paper's CCR (Eq. 7, the columns of its appendix
    tables): ring's summed block time and its summed kv transfer time (and dkv's in the
    backward) when run one after the other. A ring step's transfer is as slow as its slowest
    link; ``T_comm`` is 0 on one rank."""
    n = topo.cp_size
    blocks = [Compute(0, y, *block_parts(0, y, causal)) for y in range(n)]
    comp = sum(compute.block_time(b, shape, backward) for b in blocks)
    if n == 1:
        return comp, 0.0
    link = "cross" if topo.num_nodes > 1 else "intra"
    kv = payload_bytes(Payload(Kind.KV, 0, Part.FULL), shape, Wire.INPUT)
    step = topo.fixed_cost(link) + kv / topo.bandwidth(link)
    comm = (n - 1) * step
    if backward:  # the ring's backward also moves a float32 dkv per step
        dkv = payload_bytes(Payload(Kind.DKV, 0, Part.FULL), shape, Wire.FP32)
        comm += (n - 1) * (topo.fixed_cost(link) + dkv / topo.bandwidth(link))
    return comp, comm


def nominal_links(topo: Topology, intra_bw: float, cross_bw: float) -> Topology:
    """``topo`` with Table 2's bandwidths (GB/s) and no fixed cost per transfer: the links of
    the paper's own CCR, whose Eq. 9 takes a transfer's time as its bytes over "the available
    bandwidth" (docs/simulator.md, `CCR`)."""
    return dataclasses.replace(
        topo, intra_bw=intra_bw, cross_bw=cross_bw, intra_lat=0.0, cross_lat=0.0
    )


def nominal_ccr_parts(
    pred: Prediction, intra_bw: float, cross_bw: float
) -> tuple[tuple[float, float], tuple[float, float]]:
    """:func:`ccr_parts` of ``pred``'s problem, forward and backward, on
    :func:`nominal_links` at ``intra_bw`` / ``cross_bw`` GB/s (a preset's Table 2 rates)."""
    assert pred.compute is not None
    links = nominal_links(pred.topo, intra_bw, cross_bw)
    fwd, bwd = (
        ccr_parts(links, pred.shape, pred.compute, pred.problem.causal, b) for b in (False, True)
    )
    return fwd, bwd


def ccr(
    topo: Topology, shape: AttnShape, compute: ComputeModel, causal: bool, backward: bool
) -> float:
    """The paper's CCR (Eq. 7): ``T_comp / T_comm`` of :func:`ccr_parts`; infinite on one
    rank."""
    return ccr_ratio(ccr_parts(topo, shape, compute, causal, backward))


def ccr_ratio(parts: tuple[float, float]) -> float:
    """``T_comp / T_comm`` of :func:`ccr_parts`' pair; infinite where nothing is sent (one
    rank)."""
    comp, comm = parts
    return comp / comm if comm else float("inf")


def predict(
    topo: Topology,
    problem: Problem,
    compute: ComputeModel,
    methods: tuple[str, ...] | None = None,
    mode: str = "auto",
    options: PlanOptions | None = None,
    record: bool = False,
    rewrite: Callable[[ProgramSet], ProgramSet] | None = None,
    a2a_topo: Topology | None = None,
    check: Callable[[PlanOptions, Layout, AttnShape], None] = check_shape,
    progress: Callable[[str, int, int], None] | None = None,
    full_max_ranks: int = FULL_MODE_MAX_RANKS,
) -> Prediction:
    """Replay forward and backward of every method in ``methods``, each with ``options`` (its
    method replaced). ``None``: every method that can split the problem (``a2a`` only when the
    heads divide over the CP group); a method in ``methods`` that cannot raises ``ValueError``
    (``check``: the rule that says so; our executor's by default).
    ``rewrite``, if given, maps each method's programs to the ones replayed (the paper's
    baselines, :mod:`megatron_charm.sim.baselines`). ``a2a_topo``, if given, is the links that
    ``tasp``'s all-to-all steps run on instead of ``topo``
    (:meth:`megatron_charm.sim.topology.Hardware.a2a_topology`). ``progress``, if given, is
    called with ``(method, index, count)`` before each method's replay. ``full_max_ranks``:
    the largest group that ``mode="auto"`` replays in full (:func:`programs`)."""
    options = options if options is not None else PlanOptions()
    shape = problem.shape(topo.cp_size)
    layout = Layout(topo.num_nodes, topo.ranks_per_node)
    if methods is None:
        methods = methods_for(layout, shape)
    for method in methods:
        check(options.replace(method=method), layout, shape)
    parts = tuple(ccr_parts(topo, shape, compute, problem.causal, bwd) for bwd in (False, True))
    pred = Prediction(
        topo,
        problem,
        shape,
        *map(ccr_ratio, parts),
        compute=compute,
        ccr_seconds=parts,  # type: ignore[arg-type]
    )
    for k, method in enumerate(methods):
        if progress is not None:
            progress(method, k, len(methods))
        progs = programs(
            options.replace(method=method), layout, problem.causal, mode, shape, full_max_ranks
        )
        if rewrite is not None:
            progs = rewrite(progs)
        links = a2a_topo if method == "tasp" and a2a_topo is not None else topo
        fwd = simulate_pass(progs, links, shape, compute, False, record)
        bwd = simulate_pass(progs, links, shape, compute, True, record)
        pred.methods[method] = MethodPrediction(method, fwd, bwd)
    return pred


@dataclass
class Advice:
    """A recommended ``cp_comm_type`` and the reasons."""

    method: str
    reasons: list[str]
    prediction: Prediction


def advise(pred: Prediction) -> Advice:
    """Pick the method with the lowest forward + backward time; ties go to the simpler method.
    Only methods on Megatron's zigzag layout are candidates (``SIMPLICITY``: not ``ring-contig``,
    a baseline that Megatron refuses)."""
    best = min((mp for m, mp in pred.methods.items() if m in SIMPLICITY), key=lambda mp: mp.total)
    tied = [
        m
        for m in SIMPLICITY
        if m in pred.methods and pred.methods[m].total <= best.total * (1 + TIE)
    ]
    choice = tied[0]
    reasons = [_margin(pred, choice), _ccr(pred)]
    if choice != best.method:
        reasons.append(
            f"{best.method} is within {TIE:.0%} ({best.total * 1e3:.2f} ms); {choice} is simpler"
        )
    if pred.topo.num_nodes > 1:
        reasons.append(_cross_bytes(pred, choice))
    reasons += [
        _exposure(pred, name) for name in dict.fromkeys([choice, "ring"]) if name in pred.methods
    ]
    approximate = margin_replay_error(pred, choice)
    if approximate:
        reasons.append(
            f"replayed for one node (Note [Node symmetry]); {one_node_note(approximate)}"
        )
    return Advice(choice, reasons, pred)


def one_node_note(errors: dict[str, float]) -> str:
    """What a prediction's one-node replays of causal plans may be off by (``errors``, from
    :func:`replay_error`)."""
    return f"against full replays of up to 64 x 8 such times are off by {error_list(errors)}"


def error_list(errors: dict[str, float]) -> str:
    """``"up to 22% for charm, up to 7% for rm+"``."""
    return ", ".join(f"up to {e:.0%} for {m}" for m, e in errors.items())


def replay_error(pred: Prediction, methods: Iterable[str]) -> dict[str, float]:
    """The known error (:data:`~megatron_charm.sim.programs.SYMMETRIC_ERROR`) of each of
    ``methods`` that ``pred`` replayed for one node only and not exactly: a causal plan's
    one-node replay against its full replay. Empty where every one was replayed exactly."""
    out = {}
    for m in methods:
        mp = pred.methods.get(m)
        if mp is not None and not mp.exact and SYMMETRIC_ERROR.get(m, 0.0) > 0:
            out[m] = SYMMETRIC_ERROR[m]
    return out


def margin_replay_error(pred: Prediction, choice: str) -> dict[str, float]:
    """:func:`replay_error` of the two times behind ``choice``'s margin: its own and the
    :func:`runner_up`'s."""
    nxt = runner_up(pred, choice)
    return replay_error(pred, [choice] + ([nxt.method] if nxt else []))


def combined_error(*errors: float) -> float:
    """The relative error of a time off by each of ``errors`` in turn: ``prod(1 + e) - 1``."""
    out = 1.0
    for e in errors:
        out *= 1.0 + e
    return out - 1.0


def margin_range(margin: float, error: float) -> tuple[float, float]:
    """The range of a predicted ``margin`` (one time over another) when each time may be off
    by the relative ``error`` (capped at 0.9): ``margin * (1 - e) / (1 + e)`` to
    ``margin * (1 + e) / (1 - e)``, as ``advise`` quotes it."""
    e = min(error, 0.9)
    return margin * (1 - e) / (1 + e), margin * (1 + e) / (1 - e)


def speedup_range(
    pred: Prediction, method: str, backward: bool, error: float
) -> tuple[float, float]:
    """The range of ``method``'s predicted speedup over ring in one pass when each of the two
    times may be off by the hardware numbers' relative ``error`` (a preset's worst miss of the
    paper's rows, a profile's worst fit), combined with the larger one-node replay error of the
    two (:func:`replay_error`): :func:`margin_range` of the speedup, as ``advise`` quotes the
    margin of its choice."""
    approximate = replay_error(pred, ("ring", method))
    err = combined_error(error, max(approximate.values(), default=0.0))
    return margin_range(pred.speedup(method, backward), err)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _margin(pred: Prediction, choice: str) -> str:
    """The choice's predicted time and its margin over the next method."""
    mp = pred.methods[choice]
    nxt = runner_up(pred, choice)
    text = f"predicted forward+backward {_ms(mp.total)} with {choice}"
    if nxt is not None:
        text += f"; next {nxt.method} {_ms(nxt.total)} ({nxt.total / mp.total:.2f}x)"
    if "ring" in pred.methods and choice != "ring" and (nxt is None or nxt.method != "ring"):
        text += f"; ring {_ms(pred.methods['ring'].total)}"
    return text


def runner_up(pred: Prediction, choice: str) -> MethodPrediction | None:
    """The fastest candidate (``SIMPLICITY``: not a baseline) other than ``choice``, if any."""
    others = [m for m in pred.methods.values() if m.method != choice and m.method in SIMPLICITY]
    return min(others, key=lambda m: m.total, default=None)


def _ccr(pred: Prediction) -> str:
    """The CCR with what it means for this problem."""

    def say(x: float) -> str:
        if x >= 1:
            return f"compute {x:.2f}x its communication"
        return f"communication {1 / x:.2f}x its compute"

    return (
        f"ring run step by step: forward {say(pred.ccr_forward)}, backward "
        f"{say(pred.ccr_backward)} (CCR {pred.ccr_forward:.2f} / {pred.ccr_backward:.2f})"
    )


def _cross_bytes(pred: Prediction, choice: str) -> str:
    """Bytes over cross-node links, forward + backward, of the choice against ring."""

    def cross(name: str) -> float:
        mp = pred.methods[name]
        total = mp.forward.link_bytes().get("cross", 0) + mp.backward.link_bytes().get("cross", 0)
        return total / 1e6

    text = f"cross-node bytes (forward+backward, simulated ranks): {choice} {cross(choice):.1f} MB"
    if "ring" in pred.methods and choice != "ring":
        text += f", ring {cross('ring'):.1f} MB"
    return text


def _exposure(pred: Prediction, name: str) -> str:
    """How much of a method's time is communication that nothing overlaps."""
    mp = pred.methods[name]
    parts = []
    for tag in ("forward", "backward"):
        res = getattr(mp, tag)
        share = res.exposed_mean / res.makespan if res.makespan else 0.0
        parts.append(f"{tag} {_ms(res.exposed_mean)} of {_ms(res.makespan)} ({share:.0%})")
    return f"{name}: exposed communication (mean over ranks) " + ", ".join(parts)


def describe_links(topo: Topology) -> str:
    """One line that states the link model behind a prediction (tables and JSON)."""
    fabric = topo.fabric
    if topo.fabric == "nvlink" and topo.nvlink_egress > 0:
        fabric += f", {topo.nvlink_egress:g} GB/s per GPU and direction"
    if topo.fabric == "pcie" and topo.pcie_domain > 0:
        fabric += f", {topo.pcie_domain:g} GB/s per node and direction"
    on_link = " (time on the link)" if topo.cross_lat_on_link else ""
    return (
        f"intra {topo.intra_bw:g} GB/s ({fabric}), {topo.nics} cross link(s) per node at "
        f"{topo.cross_bw:g} GB/s each, latency {topo.intra_lat * 1e6:g} / "
        f"{topo.cross_lat * 1e6:g} us{on_link}"
    )
