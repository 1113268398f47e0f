"""Hardware profiles: what the simulator assumes about a cluster, measured or taken from the paper.

A profile holds the link model (intra/cross bandwidth and latency, cross links per node, fabric)
and the compute model (a fitted :class:`~megatron_charm.sim.compute.FittedCompute`, or the
paper's TFLOPS x efficiency). ``megatron-charm-sim calibrate`` measures one on the user's own
ranks (:mod:`megatron_charm.sim.calibrate`) and writes it as JSON; ``--profile`` loads it, and so
does ``--cp-comm-type auto``. The paper's Table 2 systems are profiles too (``H100``, ``H20``,
``L20``), marked as not measured on the user's hardware.

Note [Fitting a profile]
~~~~~~~~~~~~~~~~~~~~~~~~
Every measured quantity is a straight line through timings over sizes, fitted by least squares on
the relative residuals::

    block kernel   t = overhead + elements * per_element + flops / rate
                                          (forward; backward at 2.5 x the FLOPs; Note [Block
                                           shapes] in megatron_charm/sim/compute.py; on a GPU
                                           the flops of whole tiles in whole waves over its
                                           SMs, Note [Tiles and waves])
    P2P transfer   t = latency  + bytes / bandwidth     (intra-node pair, cross-node pair)
    merge          t = 3 * bytes / memory bandwidth

A negative coefficient (noise on a machine whose overhead is small) is dropped and the rest
refitted. The blocks are timed at the configured heads and at one head (``--kernel-heads``), the
shape of a head-split method's blocks, so that the fit can tell a cost per call from one per row.
Where every rank runs on one host the blocks are timed one rank at a time, and the profile
records how many ranks the host runs at full speed at once (Note [Ranks sharing a host]).
The compute slowdown under communication is the largest block's time while the rank streams
messages to a partner in a background thread, over its time alone (at least 1). On a CPU host
the kernel's own CPU seconds inside passes of the real attention, over what the fitted blocks
give the same passes, scale every block (Note [Blocks in a pass] in
megatron_charm/sim/in_pass.py; ``fit_error["blocks_in_pass"]``: how far one method's ratio
lies from it).
Cross links per node come from one more timing: every rank of node 0 sends to its counterpart
on node 1 at once. If ``k`` flows share a link, each gets ``1/k`` of it, so the links per node are
``p / k``, rounded to a divisor of ``p`` (1: ``shared``, ``p``: ``rails``). With ``--fabric pcie``
and four or more ranks per node, disjoint pairs of node 0 ping-pong at once as well: if each of
the ``k`` flows runs below 0.9 of one pair's rate, the node's GPUs share a PCIe domain of ``k``
times that rate (Note [One PCIe domain] in megatron_charm/sim/topology.py). The concurrent
cross-node timing is taken at the smallest size too, where a transfer is mostly its fixed cost
``lat``: with ``k`` flows on a link it takes ``lat + k n / bw`` if that cost is a delay and
``k (lat + n / bw)`` if it is time on the link (Note [A fixed cost on the link]), and the large
timing likewise. Where the two readings of the small timing differ by a quarter or more, the
profile takes the cost on the link if, at its best link count, it explains both timings better
than a delay does at the link count the large timing gives (``cross_sharing``;
``cross_lat_on_link``; calibrations before 2026-12-05 have no small timing: a delay). The
largest relative
residual of each fit is kept in the profile (``fit_error``): it is how far the model is known to
miss its own measurements, and predictions made with the profile quote it. So is how far the
largest block's time moved between the run's start and end (``drift``, Note [A calibration's
drift] in megatron_charm/sim/repeats.py).

``calibrate --repeat N`` measures ``N`` times and fits the median run, or the median of each
timing (Note [Repeated calibrations] in megatron_charm/sim/repeats.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Layout, Part
from megatron_charm.sim.compute import (
    ComputeModel,
    Enqueue,
    FittedCompute,
    FlopsCompute,
    block_elements,
    block_flops,
    kernel_flops,
)
from megatron_charm.sim.in_pass import fit_in_pass, fit_transport_in_pass
from megatron_charm.sim.repeats import speed_drift
from megatron_charm.sim.topology import FABRICS, PRESETS, Topology, parse_gpus

FORMAT = "megatron-charm-profile/1"


@dataclass(frozen=True)
class Profile:
    """A cluster's links and compute, as the simulator uses them."""

    name: str
    """What it describes (``"H100 (paper Table 2)"``, ``"measured 2x2 gloo cpu bf16"``)."""
    measured: bool
    """True when ``megatron-charm-sim calibrate`` measured it on real ranks."""
    gpus: str
    """``m x p`` it was measured on (or the paper's default split); predictions may use others."""
    intra_bw: float
    """Intra-node P2P bandwidth, GB/s."""
    cross_bw: float
    """Bandwidth of one cross-node link, GB/s."""
    intra_lat: float
    """Intra-node latency, seconds."""
    cross_lat: float
    """Cross-node latency, seconds."""
    nics_per_node: int
    """Cross links per node; 0 means one per rank (rails)."""
    fabric: str
    """``nvlink`` or ``pcie`` (assumed unless given to ``calibrate``)."""
    compute: dict
    """``{"kind": "fitted", ...FittedCompute fields}`` or ``{"kind": "flops", ...}``."""
    exchange_order: str = "channel"
    """How exchanges on one channel proceed: ``"channel"`` (NCCL) or ``"pair"`` (gloo);
    :attr:`megatron_charm.sim.topology.Topology.exchange_order`."""
    fit_error: dict = field(default_factory=dict)
    """Largest relative residual of each fit (``kernel_fwd``, ``kernel_bwd``, ``intra``,
    ``cross``), Note [Fitting a profile]."""
    provenance: dict = field(default_factory=dict)
    """Date, command, device, dtype, backend and the raw samples' summary."""
    nvlink_egress: float = 0.0
    """GB/s per GPU and direction that its NVLink flows share
    (:attr:`megatron_charm.sim.topology.Topology.nvlink_egress`); presets only, 0 when
    measured."""
    pcie_domain: float = 0.0
    """GB/s per node and direction that all its PCIe transfers share
    (:attr:`megatron_charm.sim.topology.Topology.pcie_domain`); measured by ``calibrate
    --fabric pcie`` on four or more ranks per node (Note [Fitting a profile]), else 0."""
    preset: str = ""
    """The paper's Table 2 system it was made from (``"H100"``); ``""`` for a measured one."""
    cross_lat_on_link: bool = False
    """Whether ``cross_lat`` is time on the link rather than a delay
    (:attr:`megatron_charm.sim.topology.Topology.cross_lat_on_link`): the H20 preset; measured
    by ``calibrate`` on two or more ranks per node (Note [Fitting a profile])."""

    def __post_init__(self) -> None:
        if self.fabric not in FABRICS:
            raise ValueError(f"profile {self.name!r}: fabric {self.fabric!r} not in {FABRICS}")
        self.compute_model()  # validates the numbers
        self.topology(*parse_gpus(self.gpus))

    def topology(self, num_nodes: int, ranks_per_node: int) -> Topology:
        """The profile's links for an ``num_nodes x ranks_per_node`` CP group. A measured link
        count per node that does not divide ``ranks_per_node`` falls back to one per rank."""
        k = self.nics_per_node
        if k and ranks_per_node % k:  # (also true for k > ranks_per_node)
            k = 0
        return Topology(
            num_nodes,
            ranks_per_node,
            self.intra_bw,
            self.cross_bw,
            intra_lat=self.intra_lat,
            cross_lat=self.cross_lat,
            fabric=self.fabric,
            cross_links="shared" if k == 1 else "rails",
            nics_per_node=0 if k == 1 else k,
            exchange_order=self.exchange_order,
            nvlink_egress=self.nvlink_egress,
            pcie_domain=self.pcie_domain,
            cross_lat_on_link=self.cross_lat_on_link,
        )

    def compute_model(self) -> ComputeModel:
        c = dict(self.compute)
        kind = c.pop("kind", None)
        if kind == "fitted":
            return FittedCompute(**c)
        if kind == "flops":
            return FlopsCompute(**c)
        raise ValueError(
            f"profile {self.name!r}: compute kind {kind!r} is not 'fitted' or 'flops'; rerun "
            "megatron-charm-sim calibrate"
        )

    @property
    def preset_error(self) -> float | None:
        """For an unmeasured profile made from one of the paper's systems, how far the model
        misses that GPU's rows of the paper's Tables 4 and 5 (:attr:`Hardware.paper_error`, which
        ``advise`` quotes); ``None`` for any other profile."""
        hw = None if self.measured else PRESETS.get(self.preset)
        return None if hw is None else hw.paper_error

    @property
    def known_error(self) -> float | None:
        """The largest relative residual of the profile's fits; ``None`` for an unmeasured one."""
        return max(self.fit_error.values()) if self.fit_error else None

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _preset_key(name: object) -> str | None:
    """The key of :data:`PRESETS` that ``name`` names in any case, else ``None``."""
    return {k.lower(): k for k in PRESETS}.get(str(name).lower())


def preset_profile(name: str) -> Profile:
    """The paper's Table 2 system ``name`` (``H100``, ``H20``, ``L20``, any case, as
    :func:`load_profile` takes it) as a profile."""
    key = _preset_key(name)
    if key is None:
        raise ValueError(
            f"preset_profile(name={name!r}): unknown preset; pass one of "
            f"{', '.join(sorted(PRESETS))} (any case), or load a calibrated JSON with "
            "load_profile(PATH)"
        )
    name = key
    hw = PRESETS[name]
    return Profile(
        name=f"{hw.name} (paper Table 2; not measured on this cluster)",
        measured=False,
        gpus=hw.gpus,
        intra_bw=hw.intra_achieved,
        cross_bw=hw.cross_achieved,
        intra_lat=hw.intra_lat,
        cross_lat=hw.cross_lat,
        nics_per_node=hw.nics_per_node or (1 if hw.cross_links == "shared" else 0),
        fabric=hw.fabric,
        nvlink_egress=hw.nvlink,
        pcie_domain=hw.pcie_domain,
        cross_lat_on_link=hw.cross_lat_on_link,
        preset=name,
        compute={
            "kind": "flops",
            "tflops": hw.tflops,
            "efficiency": hw.efficiency,
            "mem_bw": hw.mem_bw,
            "enqueue": asdict(hw.enqueue),
            "sms": hw.sms,
        },
    )


def load_profile(spec: str | Path | Profile) -> Profile:
    """A profile from a preset name (``H100``, ``H20``, ``L20``, any case) or a JSON file that
    ``megatron-charm-sim calibrate`` wrote."""
    if isinstance(spec, Profile):
        return spec
    if _preset_key(spec) is not None:
        return preset_profile(str(spec))
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"profile {str(spec)!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
            "file; write one with `megatron-charm-sim calibrate --out PROFILE.json` and pass its "
            "path (--profile / --charm-profile / attention.profile)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"profile {str(path)!r} is not JSON ({err}); rerun calibrate") from err
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        raise ValueError(
            f"profile {str(path)!r} has format {found!r}, expected {FORMAT!r}; rerun "
            "megatron-charm-sim calibrate"
        )
    data.pop("format")
    try:
        return Profile(**data)
    except TypeError as err:
        raise ValueError(
            f"profile {str(path)!r}: {err}; rerun megatron-charm-sim calibrate"
        ) from err


# -- fitting (Note [Fitting a profile]) ----------------------------------------------------------


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``y = a + b x`` minimising the squared *relative* residuals (weights ``1 / y^2``: a small
    block mispredicted by half matters as much as a large one), with ``a >= 0`` (refit through
    the origin when the free fit gives ``a < 0``). Returns ``(a, b)``."""
    if len(xs) != len(ys) or not xs or min(ys) <= 0:
        raise ValueError(f"fit_line needs equal, non-empty, positive samples (got {xs}, {ys})")
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs, strict=True)) / sw
    my = sum(wi * y for wi, y in zip(w, ys, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs, strict=True))
    if len(xs) >= 2 and sxx > 0:
        b = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys, strict=True)) / sxx
        a = my - b * mx
        if a >= 0 and b > 0:
            return a, b
    num = sum(wi * x * y for wi, x, y in zip(w, xs, ys, strict=True))
    return 0.0, num / sum(wi * x * x for wi, x in zip(w, xs, strict=True))


def fit_nonnegative(
    features: list[tuple[float, ...]], ys: list[float], drop_order: tuple[int, ...]
) -> tuple[float, ...]:
    """``y = sum(c_i x_i)`` minimising the squared relative residuals (weights ``1 / y^2``, as
    :func:`fit_line`) with every ``c_i >= 0``. While a coefficient comes out negative, or the
    samples cannot tell the features apart, the first feature of ``drop_order`` still in the fit
    is fixed at 0 (the most negative one, where one of them is negative) and the rest refitted;
    the features not in ``drop_order`` always stay.
    ``features``: one tuple per sample."""
    if len(features) != len(ys) or not ys or min(ys) <= 0:
        raise ValueError(f"fit_nonnegative needs equal, non-empty, positive samples (got {ys})")
    width = len(features[0])
    active = [i for i in range(width) if any(f[i] for f in features)]
    droppable = [i for i in drop_order if i in active]
    # columns scaled to at most 1: FLOPs and a constant differ by ten orders of magnitude
    scale = [max(abs(f[i]) for f in features) or 1.0 for i in range(width)]
    while True:
        coef = _weighted_lstsq(
            [[f[i] / scale[i] / y for i in active] for f, y in zip(features, ys, strict=True)]
        )
        if coef is not None and min(coef) >= 0:
            out = [0.0] * width
            for i, c in zip(active, coef, strict=True):
                out[i] = c / scale[i]
            return tuple(out)
        if not droppable:
            raise ValueError(f"fit_nonnegative: no non-negative fit to {ys}")
        drop = droppable[0]
        if coef is not None:  # the most negative droppable coefficient, if any is negative
            worst = min(droppable, key=lambda i: coef[active.index(i)])
            drop = worst if coef[active.index(worst)] < 0 else drop
        droppable.remove(drop)
        active.remove(drop)


def _weighted_lstsq(rows: list[list[float]]) -> list[float] | None:
    """Least squares of ``rows @ c = 1`` through the normal equations (a few unknowns);
    ``None`` when they are singular."""
    k = len(rows[0])
    a = [
        [sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] for r in rows)]
        for i in range(k)
    ]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) <= 1e-12 * max(1.0, max(abs(x) for x in a[piv][:k])):
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][k] / a[i][i] for i in range(k)]


def fit_link(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """:func:`fit_line` for transfer samples ``(bytes, seconds)``: while the fit needs a negative
    latency, the smallest transfer is dropped and the rest refit (down to the two largest). A
    small transfer that beats the large ones' rate (a traffic shaper's burst, a cache) says
    nothing about the link's sustained rate, which the attention's transfers see, and pulling
    the line through the origin would raise the rate by it. Returns ``(latency, seconds per
    byte)``."""
    pairs = sorted(zip(xs, ys, strict=True))
    while len(pairs) > 2:
        a, b = fit_line([x for x, _ in pairs], [y for _, y in pairs])
        if a > 0:
            return a, b
        pairs = pairs[1:]
    return fit_line([x for x, _ in pairs], [y for _, y in pairs])


def max_rel_residual(xs: list[float], ys: list[float], a: float, b: float) -> float:
    return max(abs(a + b * x - y) / y for x, y in zip(xs, ys, strict=True) if y > 0)


def _divisors(p: int) -> list[int]:
    return [k for k in range(1, p + 1) if p % k == 0]


def _divisor_near(p: int, x: float) -> int:
    return min(_divisors(p), key=lambda k: (abs(math.log(k) - math.log(max(x, 1e-9))), k))


#: One unmasked block of a rank's own queries and keys: the shape of every kernel sample.
FULL_BLOCK = Compute(0, 1, Part.FULL, Part.FULL, False)


def sample_shape(batch: int, heads: int, head_dim: int, tokens: int) -> AttnShape:
    """The shape of a kernel sample: ``tokens`` queries and keys, as many kv heads as q heads."""
    return AttnShape(batch, tokens, heads, heads, head_dim)


def block_flops_full(batch: int, heads: int, head_dim: int, tokens: int) -> float:
    """Forward FLOPs of one unmasked ``tokens x tokens`` block (``QK^T`` and ``PV``)."""
    return block_flops(FULL_BLOCK, sample_shape(batch, heads, head_dim, tokens), False)


def block_elements_full(batch: int, heads: int, head_dim: int, tokens: int) -> float:
    """Elements of the rows of one ``tokens x tokens`` block, queries and keys (Note [Block
    shapes] in :mod:`megatron_charm.sim.compute`)."""
    return block_elements(FULL_BLOCK, sample_shape(batch, heads, head_dim, tokens))


def fit_kernel(
    samples: list[dict], backward: bool, sms: int = 0
) -> tuple[float, float, float, float]:
    """``(overhead, seconds per element, seconds per FLOP, largest relative residual)`` of the
    forward (or backward) block times of ``samples`` (Note [Fitting a profile]); with ``sms``
    (a GPU's), the FLOPs are those of whole tiles in whole waves."""
    feats, ys = [], []
    for k in samples:
        shape = sample_shape(k["batch"], k["heads"], k["head_dim"], k["tokens"])
        feats.append(
            (1.0, block_elements(FULL_BLOCK, shape), kernel_flops(FULL_BLOCK, shape, backward, sms))
        )
        ys.append(k["bwd_s" if backward else "fwd_s"])
    # the FLOPs term always stays; then the per-element term goes first (a single head count
    # and one size cannot tell it from the rest), then the overhead
    c0, c1, c2 = fit_nonnegative(feats, ys, drop_order=(1, 0))
    worst = max(abs(c0 + c1 * f[1] + c2 * f[2] - y) / y for f, y in zip(feats, ys, strict=True))
    return c0, c1, c2, worst


class HostWork(NamedTuple):
    """Host seconds of a call outside its kernels, one rank's alone (Note [Host work of a
    call])."""

    call: float = 0.0
    """Per pass, on the rank's thread."""
    post: float = 0.0
    """Per exchange posted, on the rank's thread."""
    byte: float = 0.0
    """Per byte sent, on the rank's thread."""
    transport_post: float = 0.0
    """Per exchange, in the transport's threads."""
    transport_byte: float = 0.0
    """Per byte sent, in the transport's threads."""
    element_fwd: float = 0.0
    """Per element of the rank's queries (``b x s_local x h x d``) in a forward pass, on the
    rank's thread."""
    element_bwd: float = 0.0
    """The same in a backward pass."""

    def total(
        self, exchanges: float, nbytes: float, elements: float = 0.0, backward: bool = False
    ) -> float:
        """CPU seconds of a pass that posts ``exchanges`` and sends ``nbytes``, on a rank whose
        queries hold ``elements``."""
        posts = (self.post + self.transport_post) * exchanges
        per_element = self.element_bwd if backward else self.element_fwd
        return (
            self.call + posts + (self.byte + self.transport_byte) * nbytes + per_element * elements
        )


def host_work(raw: dict, slots: float) -> HostWork:
    """Note [Host work of a call]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A call of the attention costs the host more than its kernels: the autograd function, the
    plan lookup and the buffers, the executor's work around each instruction, and the
    transport's work to move each byte (copies into and out of its buffers and the TCP stack at
    both ends). On the 2-core testbed a ring forward at 16 tokens per rank took 14 ms, almost
    all of it such work. Where the ranks share one host, it takes cores from the kernels of
    every rank: on eight ranks with fast links the sweep's processes kept the two cores 90-98%
    busy, and with the host work read from the trace alone (below) the replay charged the host
    about half the CPU they used, and its passes came out up to 49% too fast
    (docs/results/calibrated-2x2.md).

    ``calibrate`` measures it as CPU time (``time_host_cpu`` in
    :mod:`megatron_charm.sim.calibrate_worker`): passes of the real attention with a block
    kernel that computes nothing, for three methods at three sizes, every rank at once. It
    reads each pass's CPU seconds twice: of the thread that called the attention, and of the
    whole process; the difference ran in the transport's threads (gloo's). Each part is fitted
    on its own (non-negative, :func:`fit_nonnegative`):

        thread    = call + post x (exchanges posted) + byte x (bytes sent)
                    + element x (elements of the rank's queries), one per pass direction
        transport =        transport_post x (exchanges) + transport_byte x (bytes sent)

    The thread's work grows with the size of the rank's problem, not with the bytes it sends:
    at 256 / 512 / 1024 tokens a ring backward sends three times charm's bytes and takes the
    same CPU. Fitted per byte instead of per element, the thread's work missed its own samples
    by up to 50%, charm's forward from +35% at 256 tokens to -20% at 1024; per element, by up
    to 19-24% (2026-12-04, the four profiles of docs/results/calibrated-2x2.md). An element
    term charges the buffers the pass allocates, casts and merges on its own thread.

    CPU seconds are one rank's alone: no scaling for the sharing. The engine charges the
    thread's part on the rank's stream (``call`` and ``element`` around every pass's
    instructions, Note [Where a call's host work runs]; ``post`` and ``byte`` before every
    exchange is posted), and the transport's part as a flow on the shared
    host while the exchange is in flight: it takes its share of the cores, slowing every rank's
    blocks, and nothing waits for it (Note [Ranks sharing a host] in
    :mod:`megatron_charm.sim.engine`).

        stream  |call|post|  block  |post|   block   |...
        cores        ~~~~~~~ transport, exchange 1 ~~~~~~~     (shares the cores)

    Known limits: the bytes are priced at the rate of the link calibrate ran on, and the
    transport's work per byte is two to three times larger on a 50 Mbit/s link than on a
    1 Gbit/s one (scripts/bench/transport_cpu.py); in passes whose ranks compute, the
    transport's threads take more than these null-kernel passes give, which the fit measures
    and scales by (Note [Transport in a pass] in :mod:`megatron_charm.sim.in_pass`); the
    thread's work per byte (packing, unpacking, accumulating) happens around the exchange, not
    all before it; merges of the null kernel's zeros are counted here (in the element term) as
    well as in the merges.
    Samples taken before the elements were recorded fit without the element term.

    Raw samples from before this measurement carry only the attention's trace: the time from a
    pass's call to its first instruction and each exchange's posting time, wall seconds taken
    with every rank at once, scaled to one rank's alone by slots over ranks (at most 1), and
    nothing per byte or in the transport's threads.

    Zeros without samples or on a GPU, where host work is enqueue work that runs ahead of the
    device (:func:`enqueue_work`).
    """
    if raw.get("device") == "cuda":
        return HostWork()
    cpu = raw.get("host_cpu")
    if cpu:
        feats = [(1.0, float(c["exchanges"]), float(c["bytes"])) for c in cpu]
        rest = [(f[1:], c["cpu_s"] - c["thread_s"]) for f, c in zip(feats, cpu, strict=True)]
        rest = [(f, y) for f, y in rest if y > 0]
        other = fit_nonnegative([f for f, _ in rest], [y for _, y in rest], (1, 0)) if rest else ()
        other = other or (0.0, 0.0)
        threads = [c["thread_s"] for c in cpu]
        if not all("elements" in c for c in cpu):
            return HostWork(*fit_nonnegative(feats, threads, (0, 2, 1)), *other)
        feats = [
            (*f, 0.0 if c["backward"] else c["elements"], c["elements"] if c["backward"] else 0.0)
            for f, c in zip(feats, cpu, strict=True)
        ]
        call, post, byte, fwd, bwd = fit_nonnegative(feats, threads, (0, 2, 1, 3, 4))
        return HostWork(call, post, byte, *other, element_fwd=fwd, element_bwd=bwd)
    got = raw.get("host_work")
    if not got:
        return HostWork()
    alone = _alone_share(raw, slots)
    return HostWork(got["call_s"] * alone, got["post_s"] * alone)


def _alone_share(raw: dict, slots: float) -> float:
    """One rank's share of a wall time traced with every rank of ``raw``'s layout at once on a
    host of ``slots`` (at most 1; 1 without a shared host)."""
    return min(1.0, slots / (raw["nodes"] * raw["ranks_per_node"])) if slots > 0 else 1.0


def call_first(raw: dict, work: HostWork, slots: float) -> tuple[float, float]:
    """Note [Where a call's host work runs]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The fit of Note [Host work of a call] says how much CPU a call spends on its own thread
    outside its instructions' kernels and transfers (per pass and per query element), not when.
    The replay charged all of it before the first instruction, so every exchange of the pass was
    posted that much later. Little of it comes first or last. On the testbed (an Intel Xeon,
    2026-12-06 16:40 UTC, 2 x 2 at 1 Gbit/s, 1,024 tokens per rank, 4 heads of 64; the
    timelines of docs/results/calibrate/call-edges-xeon-2x2-1gbit/) charm's and ring's forward
    started their first instruction 1.1-7.1 ms after the call and returned 0.2-3.6 ms (mostly
    0.3) after their last; where the replay charged 4.6 ms alone before the first, 9 ms with four
    ranks on two cores. The rest runs inside the instructions: the buffers each block reads and
    the partial results it merges.

    ``calibrate`` traces the same calls (``time_host_work``: the time from the call to its
    first instruction, every rank at once, per pass direction since 2026-12-06 16:30 UTC, both
    directions' median before), scaled to one rank alone as the trace of Note [Host work of a
    call] is. Its share of what the fit charges the same call is the part charged before the
    first instruction; the rest is shared equally by the pass's blocks, each of which runs that
    much longer (a rank without blocks has none of it):

        first = min(1, traced seconds alone / (call + element x elements of the traced call))

        stream  |first|post| block + rest/n |post| ... | block + rest/n |

    ``(1, 1)`` (all before, as until then) without both measurements or on a GPU, whose host
    work is enqueue work (Note [Enqueue ahead])."""
    trace, cpu = raw.get("host_work"), raw.get("host_cpu")
    if raw.get("device") == "cuda" or not trace or not cpu:
        return 1.0, 1.0
    elements = next(
        (c["elements"] for c in cpu if c["s_local"] == trace["s_local"] and "elements" in c),
        None,
    )
    if elements is None:
        return 1.0, 1.0
    alone = _alone_share(raw, slots)
    firsts = []
    for backward, key in ((False, "call_fwd_s"), (True, "call_bwd_s")):
        seconds = trace.get(key, trace["call_s"]) * alone
        charged = work.call + (work.element_bwd if backward else work.element_fwd) * elements
        firsts.append(min(1.0, seconds / charged) if charged > 0 else 1.0)
    return firsts[0], firsts[1]


def host_cpu_residual(raw: dict, work: HostWork) -> float | None:
    """Largest relative miss of the host-work fit on its own ``host_cpu`` samples (their whole
    CPU seconds)."""
    cpu = raw.get("host_cpu")
    if not cpu or raw.get("device") == "cuda":
        return None
    charged = [
        work.total(c["exchanges"], c["bytes"], c.get("elements", 0), c["backward"]) for c in cpu
    ]
    return max(abs(got - c["cpu_s"]) / c["cpu_s"] for got, c in zip(charged, cpu, strict=True))


def enqueue_work(raw: dict) -> Enqueue | None:
    """A GPU's enqueue seconds per pass, exchange, kernel call and merge, from the attention's
    own trace (``time_host_work``; Note [Enqueue ahead] in :mod:`megatron_charm.sim.engine`);
    ``None`` on a CPU host or without the samples."""
    got = raw.get("host_work")
    if not got or raw.get("device") != "cuda":
        return None
    return Enqueue(got["call_s"], got["post_s"], got["kernel_s"], got["merge_s"])


#: How much the two readings of the concurrent small timing must differ, relative to the delay
#: reading, for :func:`cross_sharing` to tell them apart (Note [Fitting a profile]).
ON_LINK_MARGIN = 0.25


def _concurrent_time(t: dict, cross: tuple[float, float], flows: float, on_link: bool) -> float:
    """Seconds the concurrent timing ``t`` (``{"bytes", ...}``) takes with ``flows`` flows on a
    link of ``cross = (latency s, GB/s)``: its fixed cost once (a delay) or per flow (on the
    link)."""
    lat, gbs = cross
    wire = t["bytes"] / (gbs * 1e9)
    return flows * (lat + wire) if on_link else lat + flows * wire


def cross_sharing(conc: dict, cross: tuple[float, float], p: int) -> tuple[int, bool]:
    """``(links per node, fixed cost on the link)`` from the concurrent cross-node timings
    (``conc``: ``{"flows", "bytes", "s", "small": the same at the smallest size}``, every rank of
    node 0 with its counterpart at once) and one pair's cross ``(latency s, GB/s)``.

    With the fixed cost a delay, the large timing alone gives the flows per link (each gets
    ``1/k`` of the link). Where the small timing exists and the two readings differ there by
    :data:`ON_LINK_MARGIN` or more, the fixed cost on the link is taken if, at its best link
    count, it explains both timings better (summed squared log errors) than the delay does
    (Note [Fitting a profile]; Note [A fixed cost on the link] in
    :mod:`megatron_charm.sim.topology`)."""
    sharing = cross[1] / _per_flow_gbs(conc, cross[0])  # flows per link, as a delay
    links = _divisor_near(p, p / max(sharing, 1.0))
    small = conc.get("small")
    if not small:
        return links, False

    def error(k: int, on_link: bool) -> float:
        return sum(
            math.log(t["s"] / _concurrent_time(t, cross, p / k, on_link)) ** 2
            for t in (conc, small)
        )

    best = min(
        (k for k in _divisors(p) if p // k >= 2),
        key=lambda k: error(k, True),
        default=None,
    )
    if best is None:
        return links, False
    flows = p / best
    delay, held = (_concurrent_time(small, cross, flows, on) for on in (False, True))
    if held - delay < ON_LINK_MARGIN * delay or error(best, True) >= error(links, False):
        return links, False
    return best, True


def _per_flow_gbs(conc: dict, latency: float) -> float:
    """GB/s each flow of a concurrent timing (``{"flows", "bytes", "s"}``) achieved, after the
    link's ``latency``."""
    return conc["bytes"] / max(conc["s"] - latency, 1e-12) / 1e9


#: A concurrent flow below this fraction of one pair's rate counts as sharing a PCIe domain;
#: above it the difference is read as noise (Note [Fitting a profile]).
DOMAIN_SHARE = 0.9


def pcie_domain(conc: dict | None, intra: tuple[float, float]) -> float:
    """GB/s of a node's shared PCIe domain from ``conc`` (``{"flows", "bytes", "s"}``: disjoint
    intra-node pairs at once) and the intra-node ``(latency, GB/s)`` of one pair; 0 when the
    flows do not slow each other (or there is no timing)."""
    if not conc or conc["flows"] < 2:
        return 0.0
    per_flow = _per_flow_gbs(conc, intra[0])
    if per_flow >= DOMAIN_SHARE * intra[1]:
        return 0.0
    return per_flow * conc["flows"]


def fit_profile(raw: dict, fabric: str = "nvlink") -> Profile:
    """Fit a profile to the samples of :mod:`megatron_charm.sim.calibrate_worker`.

    ``raw``: ``{"nodes", "ranks_per_node", "device", "dtype", "backend", "kernel": [{"batch",
    "heads", "head_dim", "tokens", "fwd_s", "bwd_s", "fwd_masked_s", "bwd_masked_s"}], "merge":
    [{"bytes", "s"}], "p2p":
    {"intra": [{"bytes", "s"}], "cross": [...]}, "concurrent_cross": {"flows", "bytes", "s",
    "small": the same at the smallest size (since 2026-12-05)}, "concurrent_intra": (the same
    without "small", or ``None``)}``; ``fabric``: assumed, not measured (with
    ``"pcie"`` the concurrent intra-node timing gives :attr:`Profile.pcie_domain`).
    """
    m, p = raw["nodes"], raw["ranks_per_node"]
    ks = raw["kernel"]
    sms = int(raw.get("sms", 0))  # a GPU's (raw samples before 2026-12-04 have none)
    f0, fe, f1, ferr = fit_kernel(ks, backward=False, sms=sms)
    b0, be, b1, berr = fit_kernel(ks, backward=True, sms=sms)
    merge = raw["merge"]
    _, mslope = fit_line([3.0 * s["bytes"] for s in merge], [s["s"] for s in merge])
    err = {"kernel_fwd": ferr, "kernel_bwd": berr}
    links: dict[str, tuple[float, float]] = {}
    for cls in ("intra", "cross"):
        samples = raw["p2p"].get(cls) or []
        if not samples:
            continue
        xs, ys = [s["bytes"] for s in samples], [s["s"] for s in samples]
        lat, inv_bw = fit_link(xs, ys)
        links[cls] = (lat, 1.0 / inv_bw / 1e9)
        err[cls] = max_rel_residual(xs, ys, lat, inv_bw)
    # A missing class (one node, or one rank per node) keeps the other's numbers: it is never
    # used by a prediction on the measured shape.
    intra = links.get("intra") or links.get("cross") or (0.0, 1.0)
    cross = links.get("cross") or intra
    nics, on_link = 0, False
    conc = raw.get("concurrent_cross")
    if m > 1 and conc and conc["flows"] > 1:
        links_per_node, on_link = cross_sharing(conc, cross, p)
        nics = 0 if links_per_node == p else links_per_node
    elif m > 1 and p == 1:
        nics = 1
    domain = pcie_domain(raw.get("concurrent_intra"), intra) if fabric == "pcie" else 0.0
    slow = {"fwd": 1.0, "bwd": 1.0}
    under = raw.get("kernel_under_traffic")
    if under:
        for tag in slow:
            slow[tag] = max(1.0, under[f"{tag}_s"] / under[f"{tag}_alone_s"])
    # Note [Ranks sharing a host] in megatron_charm/sim/engine.py: blocks timed one rank at a
    # time on the host every rank shares, which runs cores / threads ranks at full speed at once
    slots = 0.0
    if raw.get("one_host"):
        slots = raw.get("host_cores", 1) / max(1, raw.get("threads", 1))
    work = host_work(raw, slots)
    first_fwd, first_bwd = call_first(raw, work, slots)
    miss = host_cpu_residual(raw, work)
    if miss is not None:
        err["host_cpu"] = miss
    # Note [Masked blocks] in megatron_charm/sim/compute.py (older raw samples have none), at
    # the most heads timed: one ratio per size
    most = max(k["heads"] for k in ks)
    masked = tuple(
        (k["tokens"], k["fwd_masked_s"] / k["fwd_s"], k["bwd_masked_s"] / k["bwd_s"])
        for k in ks
        if "fwd_masked_s" in k and k["heads"] == most
    )
    compute = FittedCompute(
        fwd_flops_per_s=1.0 / f1,
        bwd_flops_per_s=1.0 / b1,
        fwd_overhead=f0,
        bwd_overhead=b0,
        mem_bw=1.0 / mslope / 1e9,
        fwd_per_element=fe,
        bwd_per_element=be,
        fwd_slowdown=slow["fwd"],
        bwd_slowdown=slow["bwd"],
        shared_slots=slots,
        host_call_s=work.call,
        host_post_s=work.post,
        host_byte_s=work.byte,
        transport_post_s=work.transport_post,
        transport_byte_s=work.transport_byte,
        host_element_fwd_s=work.element_fwd,
        host_element_bwd_s=work.element_bwd,
        host_first_fwd=first_fwd,
        host_first_bwd=first_bwd,
        masked_cost=masked,
        enqueue=enqueue_work(raw),
        sms=sms,
    )
    drift = speed_drift(raw)  # Note [A calibration's drift]
    if drift is not None:
        err["drift"] = drift
    passes = raw.get("blocks_in_passes")
    if passes and raw.get("device") != "cuda":  # Note [Blocks in a pass]
        widest = max(ks, key=lambda k: k["heads"])
        fwd, bwd, miss = fit_in_pass(
            passes, compute, Layout(m, p), widest["batch"], most, widest["head_dim"]
        )
        # Note [Transport in a pass], against the transport's constants as fitted above
        transport, transport_miss = fit_transport_in_pass(
            passes, compute, Layout(m, p), widest["batch"], most, widest["head_dim"]
        )
        compute = replace(compute, fwd_in_pass=fwd, bwd_in_pass=bwd, transport_in_pass=transport)
        err["blocks_in_pass"] = miss
        if transport != 1.0:
            err["transport_in_pass"] = transport_miss
    return Profile(
        name=f"measured {m}x{p} {raw.get('backend', '?')} {raw.get('device', '?')} "
        f"{raw.get('dtype', '?')}",
        measured=True,
        gpus=f"{m}x{p}",
        intra_bw=intra[1],
        cross_bw=cross[1],
        intra_lat=intra[0],
        cross_lat=cross[0],
        nics_per_node=nics,
        fabric=fabric,
        pcie_domain=domain,
        cross_lat_on_link=on_link,
        # JSON's form (lists), so that a saved profile loads equal
        compute={
            "kind": "fitted",
            **asdict(compute),
            "masked_cost": [list(c) for c in compute.masked_cost],
        },
        # gloo runs a channel's exchanges at once, NCCL one after another
        exchange_order="pair" if raw.get("backend") == "gloo" else "channel",
        fit_error=err,
        provenance={k: raw[k] for k in ("device", "dtype", "backend", "date") if k in raw},
    )
