"""Blocks inside a pass against blocks alone (Note [Blocks in a pass] in
megatron_charm/sim/in_pass.py): the factor, its fit, and the kernel timing that feeds it."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from megatron_charm.kernels import BlockKernel
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Layout, Part
from megatron_charm.sim.calibrate_worker import _counting
from megatron_charm.sim.compute import FittedCompute, describe_compute
from megatron_charm.sim.in_pass import (
    fit_in_pass,
    fit_transport_in_pass,
    pass_block_seconds,
    pass_transport_seconds,
)
from megatron_charm.sim.profile import fit_profile
from tests.sim.test_profile import _raw

BLOCKS = FittedCompute(3e10, 2e10, fwd_overhead=2e-4, bwd_overhead=5e-4, shared_slots=2.0)
SHAPE = AttnShape(1, 512, 4, 4, 64)


def test_the_factor_scales_every_block_and_its_call_overhead() -> None:
    block = Compute(0, 1, Part.FULL, Part.FULL, False)
    scaled = dataclasses.replace(BLOCKS, fwd_in_pass=1.25, bwd_in_pass=1.5)
    for backward, factor in ((False, 1.25), (True, 1.5)):
        alone = BLOCKS.block_time(block, SHAPE, backward)
        assert BLOCKS.block_alone(block, SHAPE, backward) == alone  # 1: as before
        assert scaled.block_time(block, SHAPE, backward) == pytest.approx(factor * alone)
        over = BLOCKS.call_overhead(backward)
        assert scaled.call_overhead(backward) == pytest.approx(factor * over)
    # the tables and the JSON state it, where it is not 1
    assert "in a pass x1.25 forward, x1.50 backward" in describe_compute(scaled)
    assert "in a pass" not in describe_compute(BLOCKS)
    # a causal pass's blocks, the masked ones included, all scaled
    layout = Layout(2, 2)
    for backward, factor in ((False, 1.25), (True, 1.5)):
        base = pass_block_seconds(BLOCKS, "charm", layout, SHAPE, backward)
        got = pass_block_seconds(scaled, "charm", layout, SHAPE, backward)
        assert base > 0 and got == pytest.approx(factor * base)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_factor_that_is_not_positive_and_finite_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="fwd_in_pass/bwd_in_pass"):
        dataclasses.replace(BLOCKS, bwd_in_pass=bad)


def _samples(factors: dict[tuple[str, bool], float]) -> list[dict]:
    layout = Layout(2, 2)
    return [
        {
            "method": method,
            "s_local": 512,
            "backward": backward,
            "cpu_s": f * pass_block_seconds(BLOCKS, method, layout, SHAPE, backward),
        }
        for (method, backward), f in factors.items()
    ]


def test_the_fit_is_measured_over_modelled_per_direction() -> None:
    samples = _samples({("ring", False): 1.2, ("charm", False): 1.2, ("ring", True): 1.1})
    fwd, bwd, miss = fit_in_pass(samples, BLOCKS, Layout(2, 2), 1, 4, 64)
    assert (fwd, bwd) == pytest.approx((1.2, 1.1))
    assert miss == pytest.approx(0.0, abs=1e-12)
    # methods that disagree: the factor pools their seconds, the residual says how far apart
    samples = _samples({("ring", False): 1.0, ("charm", False): 1.4})
    fwd, bwd, miss = fit_in_pass(samples, BLOCKS, Layout(2, 2), 1, 4, 64)
    assert 1.0 < fwd < 1.4 and bwd == 1.0  # no backward samples: 1
    assert miss > 0.1
    assert fit_in_pass([], BLOCKS, Layout(2, 2), 1, 4, 64) == (1.0, 1.0, 0.0)


def test_fit_profile_takes_the_factor_from_a_cpu_hosts_passes() -> None:
    raw = _raw()
    plain = fit_profile(raw).compute_model()
    assert (plain.fwd_in_pass, plain.bwd_in_pass) == (1.0, 1.0)  # not measured: 1
    # passes of the raw samples' own shape (8 heads of 64), at 1.3 / 1.1 of the fitted blocks
    shape = AttnShape(1, 512, 8, 8, 64)
    raw["blocks_in_passes"] = [
        {
            "method": m,
            "s_local": 512,
            "backward": b,
            "cpu_s": (1.1 if b else 1.3) * pass_block_seconds(plain, m, Layout(2, 2), shape, b),
        }
        for m in ("ring", "charm")
        for b in (False, True)
    ]
    prof = fit_profile(raw)
    got = prof.compute_model()
    assert (got.fwd_in_pass, got.bwd_in_pass) == pytest.approx((1.3, 1.1))
    assert prof.fit_error["blocks_in_pass"] == pytest.approx(0.0, abs=1e-9)
    # a GPU's kernel time is not its thread's CPU time: never applied there
    assert fit_profile({**raw, "device": "cuda"}).compute_model().fwd_in_pass == 1.0


def test_the_counting_kernel_adds_its_calls_cpu_and_returns_their_results() -> None:
    def burn(*args, **kwargs):
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.02:
            pass
        if kwargs.get("fail"):
            raise RuntimeError("kernel failed")
        return args

    spent = [0.0]
    kernel = _counting(BlockKernel("torch", burn, burn), spent)
    assert kernel.name == "torch"  # the kernel it wraps, by name
    assert kernel.forward(1, 2) == (1, 2)
    assert kernel.backward(3) == (3,)
    assert 0.04 <= spent[0] < 1.0
    with pytest.raises(RuntimeError, match="kernel failed"):
        kernel.forward(fail=True)
    assert spent[0] >= 0.06  # a call that raises still counts


# Note [Transport in a pass]: the transport's CPU in passes of the real attention over its fit
TRANSPORT = dataclasses.replace(BLOCKS, transport_post_s=1e-4, transport_byte_s=2e-9)


def test_the_transport_factor_scales_its_work_and_the_replays_charge() -> None:
    from megatron_charm.plan import PlanOptions
    from megatron_charm.sim.engine import simulate_pass
    from megatron_charm.sim.programs import programs
    from megatron_charm.sim.topology import Topology

    doubled = dataclasses.replace(TRANSPORT, transport_in_pass=2.0)
    assert TRANSPORT.transport_work() == pytest.approx((1e-4, 2e-9))
    assert doubled.transport_work() == pytest.approx((2e-4, 4e-9))
    assert "the transport's threads x2.00 in a pass" in describe_compute(doubled)
    assert "transport's threads" not in describe_compute(TRANSPORT)
    layout = Layout(2, 2)
    per_rank = pass_transport_seconds(TRANSPORT, "ring", layout, SHAPE, False)
    assert pass_transport_seconds(doubled, "ring", layout, SHAPE, False) == pytest.approx(
        2 * per_rank
    )
    # the replay charges the shared host that much more: the transport's part, doubled
    progs = programs(PlanOptions(method="ring"), layout, True, "full", SHAPE)
    topo = Topology(num_nodes=2, ranks_per_node=2, intra_bw=1e9, cross_bw=1e8)
    base = simulate_pass(progs, topo, SHAPE, TRANSPORT).host_work
    more = simulate_pass(progs, topo, SHAPE, doubled).host_work
    assert more - base == pytest.approx(4 * per_rank)  # four ranks
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="transport_in_pass"):
            dataclasses.replace(TRANSPORT, transport_in_pass=bad)


def _transport_samples(factors: dict[tuple[str, bool], float]) -> list[dict]:
    layout = Layout(2, 2)
    return [
        {
            "method": method,
            "s_local": 512,
            "backward": backward,
            "cpu_s": 0.01,
            "thread_s": 0.03,
            "process_s": 0.03
            + f * pass_transport_seconds(TRANSPORT, method, layout, SHAPE, backward),
        }
        for (method, backward), f in factors.items()
    ]


def test_the_transport_fit_pools_every_pass() -> None:
    samples = _transport_samples({(m, b): 1.5 for m in ("ring", "charm") for b in (False, True)})
    factor, miss = fit_transport_in_pass(samples, TRANSPORT, Layout(2, 2), 1, 4, 64)
    assert factor == pytest.approx(1.5) and miss == pytest.approx(0.0, abs=1e-12)
    # samples that disagree: between them, the residual says how far apart
    samples = _transport_samples({("ring", False): 1.2, ("charm", True): 1.8})
    factor, miss = fit_transport_in_pass(samples, TRANSPORT, Layout(2, 2), 1, 4, 64)
    assert 1.2 < factor < 1.8 and miss > 0.1
    # raw samples from before (no process_s), or no transport constants: 1
    old = [{k: v for k, v in s.items() if k != "process_s"} for s in samples]
    assert fit_transport_in_pass(old, TRANSPORT, Layout(2, 2), 1, 4, 64) == (1.0, 0.0)
    assert fit_transport_in_pass(samples, BLOCKS, Layout(2, 2), 1, 4, 64) == (1.0, 0.0)


def test_fit_profile_takes_the_transport_factor_from_the_same_passes() -> None:
    raw = _raw()
    raw.update(one_host=True, host_cores=2, threads=1)
    raw["host_cpu"] = [
        {"method": "ring", "s_local": 512, "backward": False, "exchanges": ex, "bytes": nb,
         "thread_s": 1e-3, "cpu_s": 1e-3 + 1e-4 * ex + 2e-9 * nb}
        for ex, nb in ((3, 1_500_000), (7, 5_000_000), (6, 700_000))
    ]  # fmt: skip
    plain = fit_profile(raw).compute_model()
    assert plain.transport_in_pass == 1.0  # no passes: 1
    shape = AttnShape(1, 512, 8, 8, 64)  # the raw samples' own shape
    raw["blocks_in_passes"] = [
        {
            "method": m,
            "s_local": 512,
            "backward": b,
            "cpu_s": pass_block_seconds(plain, m, Layout(2, 2), shape, b),
            "thread_s": 0.05,
            "process_s": 0.05 + 1.4 * pass_transport_seconds(plain, m, Layout(2, 2), shape, b),
        }
        for m in ("ring", "charm")
        for b in (False, True)
    ]
    prof = fit_profile(raw)
    got = prof.compute_model()
    assert got.transport_in_pass == pytest.approx(1.4)
    assert got.transport_work() == pytest.approx((1.4e-4, 2.8e-9), rel=1e-5)
    assert prof.fit_error["transport_in_pass"] == pytest.approx(0.0, abs=1e-9)
    assert "x1.40 in a pass" in describe_compute(got)
