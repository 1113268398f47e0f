"""One rank of ``megatron-charm-sim calibrate``: time kernels, merges and P2P transfers.

Every rank runs the kernel and merge timings at once, as they do in training (GPUs, or hosts
whose sharing the profile does not model), and the slowest rank's median counts. Where every
rank runs on one host (``one_host``: the loopback and testbed launchers on CPU) they take turns
instead, one rank timing while the others wait, the ranks' median counts (since 2026-12-06;
:func:`_across_ranks`), and the simulator shares the host's cores
between the ranks computing at each moment (Note [Ranks sharing a host] in
:mod:`megatron_charm.sim.engine`): timed together, four ranks on two cores overlap by chance,
and two calibrations of the same machine disagreed by up to 2x on one block size. P2P timings
are ping-pongs (half the round trip) between CP rank 0 and a rank on its own node (intra) and
on the next node (cross), while the other ranks wait. The concurrent timings run every local
index of node 0 against its counterpart on node 1 at once, and disjoint pairs of node 0 at
once (Note [Fitting a profile] in :mod:`megatron_charm.sim.profile`). Last, every rank times
the largest block again while a thread of its own streams messages to a partner on another
process group, as the CP schedules overlap them: the ratio is the compute slowdown under
communication (CPU cores or GPU SMs that the transfers take). Rank 0 returns the samples; the
others return ``None``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from megatron_charm.comm.topology import CPTopology
from megatron_charm.constants import DEFAULT_TIMEOUT_S

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timed(fn, cfg: dict, device: torch.device) -> float:
    """Median seconds of ``fn`` on this rank: every rank at once, or with ``cfg["one_host"]``
    one rank at a time while the others wait at a barrier (the module docstring)."""
    if not cfg.get("one_host"):
        return _median_time(fn, cfg["reps"], device)
    seconds = 0.0
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == dist.get_rank():
            seconds = _median_time(fn, cfg["reps"], device)
    dist.barrier()
    return seconds


def _host_cores() -> int:
    """Cores this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _every_rank(value: object) -> list:
    """``value`` of every rank, in global rank order (a collective: every rank calls it)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _slowest(value: float) -> float:
    return max(_every_rank(value))


def _across_ranks(value: float, cfg: dict) -> tuple[float, list[float]]:
    """One timing from every rank's ``value`` of a :func:`_timed` measurement, and the ranks'
    values: the slowest where the ranks ran at once on devices of their own (the slowest gates
    the pass), their median where they took turns on one host (``one_host``). There each rank's
    value is one more timing of the same block on the same cores, and the slowest keeps the
    noise of the unluckiest turn: on the 2-core testbed the slowest of four ranks timed a block
    1.00-1.45 times the ranks' median (docs/results/calibrated-2x2.md, "Repeated
    calibrations")."""
    values = _every_rank(value)
    return typical_time(values, bool(cfg.get("one_host"))), values


def typical_time(values: list[float], one_host: bool) -> float:
    """The timing :func:`_across_ranks` keeps of the ranks' ``values``."""
    return statistics.median(values) if one_host else max(values)


def _block_calls(
    cfg: dict, device: torch.device, tokens: int, seed: int, causal: bool = False, heads=None
):
    """Forward and backward of one ``tokens x tokens`` block of the configured shape (``heads``:
    instead of the configured heads; causal: masked on the diagonal), run once to warm up: two
    calls without arguments."""
    from megatron_charm.kernels.backends import select_kernel

    dtype = DTYPES[cfg["dtype"]]
    kernel = select_kernel(device, dtype, cfg.get("kernel"))
    b, h, d = cfg["batch"], heads or cfg["heads"], cfg["head_dim"]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(tokens, b, h, d, generator=gen).to(device=device, dtype=dtype) for _ in range(4)
    )
    scale = d**-0.5
    out, lse = kernel.forward(q, k, v, causal, scale)
    kernel.backward(dout, q, k, v, out, lse, causal, scale)
    return (
        partial(kernel.forward, q, k, v, causal, scale),
        partial(kernel.backward, dout, q, k, v, out, lse, causal, scale),
    )


def kernel_shapes(cfg: dict) -> list[tuple[int, int]]:
    """``(heads, tokens)`` of every timed block: each size at the configured heads and at each of
    ``kernel_heads`` (Note [Block shapes] in :mod:`megatron_charm.sim.compute`)."""
    heads = sorted({cfg["heads"], *cfg.get("kernel_heads", ())})
    return [(h, tokens) for h in heads for tokens in cfg["tokens"]]


def time_kernels(cfg: dict, device: torch.device) -> list[dict]:
    """Forward and backward seconds of one ``tokens x tokens`` block per shape of
    :func:`kernel_shapes`, unmasked (``fwd_s``, ``bwd_s``) and causal-masked (``fwd_masked_s``,
    ``bwd_masked_s``; Note [Masked blocks] in :mod:`megatron_charm.sim.compute`)."""
    samples = []
    for heads, tokens in kernel_shapes(cfg):
        sample = {
            "batch": cfg["batch"],
            "heads": heads,
            "head_dim": cfg["head_dim"],
            "tokens": tokens,
        }
        for causal, tag in ((False, ""), (True, "_masked")):
            for name, (typical, ranks) in _time_block(cfg, device, tokens, heads, causal).items():
                sample[f"{name}{tag}_s"], sample[f"{name}{tag}_ranks_s"] = typical, ranks
        samples.append(sample)
    return samples


def _time_block(
    cfg: dict, device: torch.device, tokens: int, heads: int, causal: bool = False
) -> dict[str, tuple[float, list[float]]]:
    """``{"fwd": ..., "bwd": ...}``: one ``tokens x tokens`` block's timing over the ranks and
    each rank's (:func:`_across_ranks`), its forward and then its backward, every rank after a
    barrier."""
    fwd_call, bwd_call = _block_calls(cfg, device, tokens, 0, causal, heads)
    dist.barrier()
    fwd = _timed(fwd_call, cfg, device)
    dist.barrier()
    bwd = _timed(bwd_call, cfg, device)
    return {"fwd": _across_ranks(fwd, cfg), "bwd": _across_ranks(bwd, cfg)}


def time_merges(cfg: dict, device: torch.device) -> list[dict]:
    """Seconds of one float32 partial merge per size (out ``[tokens, b, h, d]``)."""
    from megatron_charm.kernels.merge import merge_partial

    b, h, d = cfg["batch"], cfg["heads"], cfg["head_dim"]
    samples = []
    for tokens in cfg["tokens"]:
        out, out_b = (torch.randn(tokens, b, h, d, device=device) for _ in range(2))
        lse, lse_b = (torch.randn(tokens, b, h, device=device) for _ in range(2))
        merge_partial(out, lse, out_b, lse_b)
        dist.barrier()
        t = _timed(partial(merge_partial, out, lse, out_b, lse_b), cfg, device)
        samples.append({"bytes": out_b.nbytes + lse_b.nbytes, "s": _across_ranks(t, cfg)[0]})
    return samples


def _ping_pong(pairs: list[tuple[int, int]], nbytes: int, reps: int, device) -> float:
    """Median half round trip of ``nbytes`` over every ``(a, b)`` global-rank pair at once; the
    slowest pair counts. Ranks in no pair only join the barriers."""
    me = dist.get_rank()
    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for a, b in pairs:
            if me == a:
                dist.send(buf, b)
                dist.recv(buf, b)
            elif me == b:
                dist.recv(buf, a)
                dist.send(buf, a)
        _sync(device)
        times.append((time.perf_counter() - t0) / 2)
    mine = statistics.median(times) if any(me in pair for pair in pairs) else 0.0
    return _slowest(mine)


def time_p2p(
    cfg: dict, ranks: list[int], m: int, p: int, device: torch.device
) -> tuple[dict, dict | None, dict | None]:
    """Ping-pong samples per link class, the concurrent cross-node timings (at the largest size,
    and at the smallest: Note [Fitting a profile]), and (four or more ranks per node) the
    concurrent intra-node one: disjoint pairs of node 0 at once."""
    classes = {}
    if p > 1:
        classes["intra"] = (ranks[0], ranks[1])
    if m > 1:
        classes["cross"] = (ranks[0], ranks[p])
    out: dict[str, list[dict]] = {}
    for cls, pair in classes.items():
        _ping_pong([pair], 4, 1, device)  # connect
        out[cls] = [
            {"bytes": n, "s": _ping_pong([pair], n, cfg["reps"], device)} for n in cfg["sizes"]
        ]
    conc = None
    if m > 1 and p > 1:
        cross_pairs = [(ranks[i], ranks[p + i]) for i in range(p)]
        conc = _concurrent(cross_pairs, cfg, device)
        # where a transfer's fixed cost sits (Note [A fixed cost on the link]): the smallest
        # size, whose time is mostly that cost
        conc["small"] = _concurrent(cross_pairs, cfg, device, min(cfg["sizes"]))
    conc_intra = None
    if p >= 4:
        pairs = [(ranks[2 * i], ranks[2 * i + 1]) for i in range(p // 2)]
        conc_intra = _concurrent(pairs, cfg, device)
    return out, conc, conc_intra


def _concurrent(pairs: list[tuple[int, int]], cfg: dict, device, nbytes: int | None = None) -> dict:
    """Every pair of ``pairs`` ping-pongs ``nbytes`` (default: the largest size) at once (after
    one connecting exchange): ``{"flows", "bytes", "s"}``."""
    n = max(cfg["sizes"]) if nbytes is None else nbytes
    _ping_pong(pairs, 4, 1, device)
    return {"flows": len(pairs), "bytes": n, "s": _ping_pong(pairs, n, cfg["reps"], device)}


def _partner(cp_rank: int, m: int, p: int) -> int | None:
    """The traffic partner: the same local index on the paired node (nodes 2k and 2k+1), else a
    neighbour inside the node; ``None`` when there is nobody."""
    node, local = divmod(cp_rank, p)
    if node ^ 1 < m:
        return (node ^ 1) * p + local
    if local ^ 1 < p:
        return node * p + (local ^ 1)
    return None


class _TrafficThread(threading.Thread):
    """A daemon thread that keeps its target's exception, so the main thread can raise it
    (``threading.Thread`` only prints it, and the calibration would go on with bad timings)."""

    def __init__(self, target: Callable[..., None], *args: object) -> None:
        super().__init__(target=target, args=args, daemon=True)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as exc:  # handed to the main thread by join_or_raise
            self.error = exc

    def join_or_raise(self, deadline_s: float) -> None:
        self.join(deadline_s)
        if self.is_alive():
            raise TimeoutError(
                f"the calibration's traffic thread is still exchanging messages after "
                f"{deadline_s:.0f} s; a peer is gone or slow, raise --timeout (cfg timeout_s)"
            )
        if self.error is not None:
            raise self.error


def time_kernels_under_traffic(
    cfg: dict, device: torch.device, ranks: list[int], m: int, p: int, solo: dict, raw: dict
) -> dict:
    """Forward and backward seconds of the largest block while this rank exchanges 1 MiB
    messages with its partner in a background thread, next to the same blocks timed alone."""
    me = dist.get_rank()
    cp_rank = ranks.index(me)
    partner = _partner(cp_rank, m, p)
    timeout_s = cfg.get("timeout_s", DEFAULT_TIMEOUT_S)  # the default group's (start_rank)
    traffic = dist.new_group(
        ranks, timeout=timedelta(seconds=timeout_s), backend=dist.get_backend()
    )
    nbytes = 1 << 20
    link = raw["p2p"].get("cross" if m > 1 else "intra") or [{"bytes": 1, "s": 1e-3}]
    one_way = max(s["s"] * nbytes / s["bytes"] for s in link)  # pessimistic for 1 MiB
    busy = cfg["reps"] * (solo["fwd_s"] + solo["bwd_s"]) + 1.0
    if cfg.get("one_host"):  # the ranks take turns (_timed)
        busy *= dist.get_world_size()
    # Both sides of a pair must run the same number of ping-pongs (each two one-way times, 1.5x
    # the kernel timings): agree on the largest estimate.
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, min(math.ceil(0.75 * busy / one_way) + 1, 100_000))
    count = max(counts)
    buf = torch.zeros(nbytes // 4, device=device)

    def stream(count: int) -> None:
        if partner is None:
            return
        peer = ranks[partner]
        for _ in range(count):
            if cp_rank < partner:
                dist.send(buf, peer, group=traffic)
                dist.recv(buf, peer, group=traffic)
            else:
                dist.recv(buf, peer, group=traffic)
                dist.send(buf, peer, group=traffic)
        _sync(device)

    fwd_call, bwd_call = _block_calls(cfg, device, solo["tokens"], 1, heads=solo["heads"])
    stream(1)  # connect the pair before anything is timed
    dist.barrier()
    worker = _TrafficThread(stream, count)
    worker.start()
    fwd = _timed(fwd_call, cfg, device)
    bwd = _timed(bwd_call, cfg, device)
    # A hung send or recv raises in the thread after timeout_s; the grace lets that error,
    # which names the failing op, arrive before the deadline's.
    worker.join_or_raise(timeout_s + 30.0)
    dist.barrier()
    return {
        "tokens": solo["tokens"],
        "messages": count,
        "fwd_s": _across_ranks(fwd, cfg)[0],
        "bwd_s": _across_ranks(bwd, cfg)[0],
        "fwd_alone_s": solo["fwd_s"],
        "bwd_alone_s": solo["bwd_s"],
    }


#: Methods whose calls :func:`time_host_work` traces.
HOST_METHODS = ("ring", "charm")


def _attention_calls(
    cfg: dict, device, topo, method: str, tokens: int, gen, kernel, spent: list | None = None
) -> list:
    """Forward and backward calls of the real attention (``method``, ``tokens`` per rank,
    ``kernel``: a name or a :class:`~megatron_charm.kernels.BlockKernel`), every rank at once
    after a barrier; the first call builds and caches the plans and is dropped. Per kept call:
    ``(trace, starts, cpu, thread, kernel_s)``, each of the last four indexed by ``backward``:
    the pass's ``time.perf_counter()`` start, its CPU seconds of the process and of this
    thread, and those of ``kernel``'s calls where it is a :func:`_counting` kernel adding to
    ``spent`` (else zeros)."""
    from megatron_charm import cp_attention

    dtype = DTYPES[cfg["dtype"]]
    shape = (cfg["batch"], tokens, cfg["heads"], cfg["head_dim"])
    q, k, v = (torch.randn(*shape, generator=gen).to(device, dtype) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(True)
    dout = torch.ones(shape, device=device, dtype=dtype)
    spent = spent if spent is not None else [0.0]
    kept = []
    for rep in range(max(cfg["reps"], 3) + 1):
        trace: list = []
        dist.barrier()
        spent[0] = 0.0
        c0, h0 = time.process_time(), time.thread_time()
        t_fwd = time.perf_counter()
        out = cp_attention(q, k, v, topo, method=method, kernel=kernel, trace=trace)
        _sync(device)
        c1, h1 = time.process_time(), time.thread_time()
        k_fwd, spent[0] = spent[0], 0.0
        t_bwd = time.perf_counter()
        out.backward(dout)
        _sync(device)
        c2, h2 = time.process_time(), time.thread_time()
        if rep > 0:
            cpu, thread = (c1 - c0, c2 - c1), (h1 - h0, h2 - h1)
            kept.append((trace, (t_fwd, t_bwd), cpu, thread, (k_fwd, spent[0])))
    return kept


def _per_exchange(events: list[tuple[str, str, float, float]]) -> list[float]:
    """Host seconds of each traced ``Exchange``, a run of exchanges posted back to back sharing
    the run's time equally: on gloo the executor posts a whole run with its last exchange (Note
    [Receives of a run first] in :mod:`megatron_charm.comm.executor`), whose event then holds
    the run's posting and the others only their staging."""
    out: list[float] = []
    for posted, run in itertools.groupby(events, key=lambda e: e[0] == "Exchange"):
        if posted:
            times = [end - start for _, _, start, end in run]
            out += [sum(times) / len(times)] * len(times)
    return out


def time_host_work(cfg: dict, device: torch.device, topo: CPTopology) -> dict:
    """Host seconds of the real attention's calls outside kernels and transfers, from its own
    trace (Note [Host work of a call] in :mod:`megatron_charm.sim.profile`): per pass, from the
    call to its first instruction (``call_s``; ``call_fwd_s`` and ``call_bwd_s`` per pass
    direction, Note [Where a call's host work runs]), and per posted exchange (``post_s``). Calls of
    ``HOST_METHODS`` at ``s_local`` 512, every rank at once as in training; medians over the
    calls and exchanges, then the slowest rank's.

    Also per kernel call (``kernel_s``) and per merge (``merge_s``): on a GPU nothing in a pass
    waits for the device, so each instruction's traced time is its enqueue (Note [Enqueue
    ahead] in :mod:`megatron_charm.sim.engine`); on a CPU host they include the work itself,
    and the profile does not use them."""
    gen = torch.Generator().manual_seed(2)
    calls: dict[bool, list[float]] = {False: [], True: []}  # per pass direction (backward)
    per_kind: dict[str, list[float]] = {"Exchange": [], "Compute": [], "Merge": []}
    for method in HOST_METHODS:
        for trace, starts, *_ in _attention_calls(
            cfg, device, topo, method, 512, gen, cfg.get("kernel")
        ):
            for run in trace:
                events = run.events
                calls[run.backward].append(events[0][2] - starts[run.backward])
                for kind, _, start, end in events:
                    if kind in ("Compute", "Merge"):
                        per_kind[kind].append(end - start)
                per_kind["Exchange"] += _per_exchange(events)
    return {
        "s_local": 512,
        "call_s": _slowest(statistics.median(calls[False] + calls[True])),
        "call_fwd_s": _slowest(statistics.median(calls[False])),
        "call_bwd_s": _slowest(statistics.median(calls[True])),
        "post_s": _slowest(statistics.median(per_kind["Exchange"])),
        "kernel_s": _slowest(statistics.median(per_kind["Compute"])),
        "merge_s": _slowest(statistics.median(per_kind["Merge"])),
    }


#: Tokens per rank of the passes :func:`time_host_cpu` measures: bytes grow with them, the
#: exchanges posted do not, so the fit can tell the two apart.
HOST_CPU_TOKENS = (256, 512, 1024)


def time_host_cpu(cfg: dict, device: torch.device, topo: CPTopology) -> list[dict]:
    """CPU seconds one rank spends in a pass of the real attention outside its kernels
    (Note [Host work of a call] in :mod:`megatron_charm.sim.profile`): calls of
    ``HOST_METHODS`` and ``a2a`` (where the heads divide over the CP group) at each of
    ``HOST_CPU_TOKENS`` tokens per rank, every rank at once, with a block kernel that computes
    nothing (``NULL_KERNEL``), so that the process's CPU time (all its threads: Python, the
    executor, gloo's transport) is the host work alone. One sample per method, size and pass:
    the ``exchanges`` posted and the ``bytes`` sent by the rank (from its trace), the
    ``elements`` of its queries (``b x s_local x h x d``); ``cpu_s``, the
    process's CPU seconds, and ``thread_s``, those of the thread that called the attention
    (the rest ran in the transport's threads), each the median over the calls of each rank,
    averaged over the ranks."""
    from megatron_charm.bench.sequential import NULL_KERNEL

    methods = list(HOST_METHODS)
    if cfg["heads"] % topo.cp_size == 0:
        methods.append("a2a")
    gen = torch.Generator().manual_seed(3)
    mine: list[tuple] = []
    for tokens in HOST_CPU_TOKENS:
        for method in methods:
            kept = _attention_calls(cfg, device, topo, method, tokens, gen, NULL_KERNEL)
            for backward in (False, True):
                run = next(r for r in kept[-1][0] if r.backward == backward)
                posted = sum(1 for e in run.events if e[0] == "Exchange")
                nbytes = sum(run.stats.bytes_sent.values())
                own = statistics.median(call[3][backward] for call in kept)
                cpu = statistics.median(call[2][backward] for call in kept)
                mine.append((method, tokens, backward, posted, nbytes, own, cpu))
    everyone = _every_rank(mine)
    return [
        {
            "method": method,
            "s_local": tokens,
            "backward": backward,
            "exchanges": posted,
            "bytes": nbytes,
            "elements": cfg["batch"] * tokens * cfg["heads"] * cfg["head_dim"],
            "thread_s": statistics.mean(theirs[j][-2] for theirs in everyone),
            "cpu_s": statistics.mean(theirs[j][-1] for theirs in everyone),
        }
        for j, (method, tokens, backward, posted, nbytes, _, _) in enumerate(mine)
    ]


#: Tokens per rank of the passes whose blocks :func:`time_blocks_in_passes` times.
IN_PASS_TOKENS = 512
#: Rounds of those passes; their median counts (Note [Blocks in a pass]: one round's ratio
#: moves by up to a fifth from one round to the next on the testbed).
IN_PASS_ROUNDS = 5


def _counting(kernel, spent: list[float]):
    """``kernel`` (a :class:`~megatron_charm.kernels.BlockKernel`) with the calling thread's CPU
    seconds of each of its calls added to ``spent[0]``."""

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - t0

        return call

    return dataclasses.replace(
        kernel, forward=timed(kernel.forward), backward=timed(kernel.backward)
    )


def time_blocks_in_passes(cfg: dict, device: torch.device, topo: CPTopology) -> list[dict]:
    """CPU seconds the block kernel takes inside passes of the real attention (Note [Blocks in
    a pass] in :mod:`megatron_charm.sim.in_pass`): calls of ``HOST_METHODS`` at
    ``IN_PASS_TOKENS`` tokens per rank, causal, every rank at once, the kernel's calls timed on
    the calling thread (``time.thread_time``: a CPU host's only), in ``cfg["in_pass_rounds"]``
    rounds (``None``: ``IN_PASS_ROUNDS``) that each run every method. One sample per method and
    pass direction: ``rounds``, per round the kernel's CPU seconds in the pass, the median over
    the calls of each rank, averaged over the ranks; ``cpu_s``, their median; ``thread_s`` and
    ``process_s``, the same of the calling thread's and the whole process's CPU seconds in the
    pass (their difference ran in the transport's threads: Note [Transport in a pass])."""
    from megatron_charm.kernels.backends import select_kernel

    spent = [0.0]
    kernel = _counting(select_kernel(device, DTYPES[cfg["dtype"]], cfg.get("kernel")), spent)
    gen = torch.Generator().manual_seed(4)
    rounds = int(cfg.get("in_pass_rounds") or IN_PASS_ROUNDS)
    mine: list[list[tuple[float, float, float]]] = []
    for _ in range(rounds):
        this_round: list[tuple[float, float, float]] = []
        for method in HOST_METHODS:
            kept = _attention_calls(cfg, device, topo, method, IN_PASS_TOKENS, gen, kernel, spent)
            # per kept call: (trace, starts, process CPU, thread CPU, kernel CPU)
            this_round += [
                tuple(statistics.median(c[j][backward] for c in kept) for j in (4, 3, 2))
                for backward in (False, True)
            ]
        mine.append(this_round)
    everyone = _every_rank(mine)
    samples = []
    for i, method in enumerate(HOST_METHODS):
        for backward in (False, True):
            col = 2 * i + backward
            per_round = [
                [statistics.mean(theirs[r][col][j] for theirs in everyone) for j in range(3)]
                for r in range(rounds)
            ]
            samples.append(
                {
                    "method": method,
                    "s_local": IN_PASS_TOKENS,
                    "backward": backward,
                    "cpu_s": statistics.median(k for k, _, _ in per_round),
                    "rounds": [k for k, _, _ in per_round],
                    "thread_s": statistics.median(t for _, t, _ in per_round),
                    "process_s": statistics.median(c for _, _, c in per_round),
                }
            )
    return samples


def run(cfg: dict) -> dict | None:
    """Measure on this rank ``cfg["repeat"]`` times (default once) in one process group;
    returns the first run's raw samples on rank 0, with the later runs' under ``"repeats"``,
    and ``None`` elsewhere."""
    from megatron_charm.bench.worker import start_rank

    device, topo = start_rank(cfg)
    runs = [_measure(cfg, device, topo) for _ in range(int(cfg.get("repeat", 1)))]
    if topo.cp_rank != 0:
        return None
    first = runs[0]
    if len(runs) > 1:
        first["repeats"] = runs[1:]
    return first


def _measure(cfg: dict, device: torch.device, topo) -> dict:
    """One calibration's raw samples (every rank takes part; rank 0's are the ones kept)."""
    m, p = topo.num_nodes, topo.ranks_per_node
    raw = {
        "nodes": m,
        "ranks_per_node": p,
        "device": device.type,
        "dtype": cfg["dtype"],
        "backend": topo.backend,
        "one_host": bool(cfg.get("one_host")),
        "host_cores": _host_cores(),
        "threads": cfg.get("threads", 1),
        # the SMs a GPU's tiles run in waves over (Note [Tiles and waves]); none on a CPU
        "sms": (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 0
        ),
        "kernel": time_kernels(cfg, device),
        "merge": time_merges(cfg, device),
    }
    raw["p2p"], raw["concurrent_cross"], raw["concurrent_intra"] = time_p2p(
        cfg, topo.global_ranks, m, p, device
    )
    if m * p > 1:
        if cfg.get("one_host") or device.type == "cuda":
            raw["host_work"] = time_host_work(cfg, device, topo)
        if cfg.get("one_host") and device.type != "cuda":
            raw["host_cpu"] = time_host_cpu(cfg, device, topo)
            raw["blocks_in_passes"] = time_blocks_in_passes(cfg, device, topo)
        largest = max(raw["kernel"], key=lambda k: (k["tokens"], k["heads"]))
        raw["kernel_under_traffic"] = time_kernels_under_traffic(
            cfg, device, topo.global_ranks, m, p, largest, raw
        )
    raw["kernel_again"] = time_largest_again(cfg, device, raw["kernel"])
    return raw


def time_largest_again(cfg: dict, device: torch.device, kernel: list[dict]) -> dict:
    """The largest block of ``kernel`` (the run's first timings) timed again at the run's end,
    alone, as :func:`time_kernels` timed it: how far the host's speed moved during the run (Note
    [A calibration's drift] in :mod:`megatron_charm.sim.repeats`)."""
    largest = max(kernel, key=lambda k: (k["tokens"], k["heads"]))
    timed = _time_block(cfg, device, largest["tokens"], largest["heads"])
    return {
        "tokens": largest["tokens"],
        "heads": largest["heads"],
        "fwd_s": timed["fwd"][0],
        "bwd_s": timed["bwd"][0],
    }
