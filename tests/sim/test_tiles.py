"""Note [Tiles and waves]: GPU block times from whole tiles in whole waves over the SMs."""

import pytest

from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Compute, Heads, Part
from megatron_charm.sim.compute import FlopsCompute, block_flops, fa2_bwd_tile, tiled_flops
from megatron_charm.sim.topology import PRESETS

FULL = Compute(0, 1, Part.FULL, Part.FULL, False)
HALF_Q = Compute(0, 1, Part.SECOND, Part.FULL, False)


def test_a_one_wave_block_costs_a_whole_tile_per_sm():
    # 210 tokens, 12 heads, batch 1: 2 query tiles x 12 heads = 24 CTAs, one wave on 132 SMs
    shape = AttnShape(1, 210, 12, 12, 192)
    tiled = tiled_flops(FULL, shape, False, 132)
    assert tiled == pytest.approx(132 * 4.0 * 128 * 210 * 192)
    assert tiled / block_flops(FULL, shape, False) == pytest.approx(6.7, abs=0.05)


def test_large_blocks_come_near_their_flops():
    # Table 5's 2 x 8 row 1: 14 tiles of 128 for 1680 tokens, 2688 CTAs in 21 waves of 132
    shape = AttnShape(16, 1680, 12, 12, 192)
    ratio = tiled_flops(FULL, shape, False, 132) / block_flops(FULL, shape, False)
    assert ratio == pytest.approx(21 * 132 * 128 / (16 * 12 * 1680), rel=1e-9)
    assert 1.0 < ratio < 1.11


def test_waves_count_whole():
    shape = AttnShape(1, 128, 1, 1, 64)  # one CTA per head
    one = tiled_flops(FULL, shape, False, 8)
    for heads, waves in ((8, 1), (9, 2), (16, 2), (17, 3)):
        s = AttnShape(1, 128, heads, heads, 64)
        assert tiled_flops(FULL, s, False, 8) == pytest.approx(waves * one)


def test_backward_tiles_the_keys_by_head_dim():
    assert fa2_bwd_tile(64) == fa2_bwd_tile(128) == 128
    assert fa2_bwd_tile(192) == fa2_bwd_tile(256) == 64
    # a half-query block: the forward has half the query tiles, the backward the same key tiles
    # backward CTAs: 1024 / 64 = 16 key tiles x 4 heads = 64, each tile over the 512 queries
    shape = AttnShape(1, 1024, 4, 4, 192)
    assert tiled_flops(HALF_Q, shape, True, 1000) == pytest.approx(
        1000 * 4.0 * 64 * 512 * 192
    )  # one wave on 1000 SMs
    # on 32 SMs the 64 CTAs run in two full waves: 64 tiles, no SM idle
    assert tiled_flops(HALF_Q, shape, True, 32) == pytest.approx(64 * 4.0 * 64 * 512 * 192)


def test_masked_blocks_and_head_groups():
    shape = AttnShape(2, 512, 16, 4, 128)
    masked = Compute(0, 0, Part.FULL, Part.FULL, True)
    assert tiled_flops(masked, shape, False, 4) == pytest.approx(
        0.5 * tiled_flops(FULL, shape, False, 4)
    )
    group = Compute(0, 1, Part.FULL, Part.FULL, False, Heads(0, 4))  # 4 of the 16 heads
    assert tiled_flops(group, shape, False, 4) == pytest.approx(
        tiled_flops(FULL, shape, False, 4) / 4
    )


def test_flops_compute_uses_tiles_only_with_sms():
    shape = AttnShape(1, 210, 12, 12, 192)
    flat = FlopsCompute(989.0, 0.5)
    tiled = FlopsCompute(989.0, 0.5, sms=132)
    # flat forward: 4 * 210 * 210 * 12 * 192 = 406,425,600 FLOPs at 494.5 TFLOP/s = 0.8219 us
    assert flat.block_time(FULL, shape, False) == pytest.approx(406_425_600 / 494.5e12)
    # tiled backward: keys in tiles of 64 (head dim 192), ceil(210 / 64) = 4 x 12 heads = 48
    # CTAs, one wave of 132 tiles of 4 * 64 * 210 * 192 = 10,321,920 FLOPs = 1,362,493,440;
    # times 2.5 for the backward, at 494.5 TFLOP/s: 6.888 us
    assert tiled.block_time(FULL, shape, True) == pytest.approx(2.5 * 1_362_493_440 / 494.5e12)
    with pytest.raises(ValueError, match="sms"):
        FlopsCompute(989.0, 0.5, sms=-1)


def test_every_preset_has_its_sm_count():
    assert {name: hw.sms for name, hw in PRESETS.items()} == {"L20": 92, "H20": 78, "H100": 132}
    assert PRESETS["H100"].compute_model().sms == 132


def test_exchanges_in_flight_hold_sms():
    # held CTAs leave sms - held SMs to the block
    tiled = FlopsCompute(989.0, 0.5, sms=132)
    assert tiled.slowdown(False, 2) == pytest.approx(132 / 130)
    assert tiled.slowdown(True, 6) == pytest.approx(132 / 126)
    assert tiled.slowdown(False, 1000) == pytest.approx(2.0)  # at most half the SMs go
    assert FlopsCompute(989.0, 0.5).slowdown(False, 4) == 1.0


def _first_exchange(method: str, cp_size: int, cp_rank: int = 0):
    from megatron_charm.plan import Layout, PlanOptions, build_plan
    from megatron_charm.plan.types import Exchange

    plan = build_plan(PlanOptions(method=method), Layout(1, cp_size), causal=False)
    return next(i for i in plan.forward[cp_rank].instrs if isinstance(i, Exchange))


def test_an_exchange_holds_two_ctas_per_round_of_peers_up_to_the_pool():
    # NCCL runs two channels (CTAs) per peer, a send to rank + j with the receive from rank - j,
    # and an exchange's peers side by side up to its pool of point-to-point channels
    from megatron_charm.sim.compute import NCCL_P2P_CHANNELS, NCCL_P2P_CTAS

    tiled = FlopsCompute(989.0, 0.5, sms=132)
    ring = _first_exchange("ring", 8)  # to the next rank, from the one before: one round
    assert {op.send for op in ring.ops} == {True, False}
    assert tiled.held_by(ring) == NCCL_P2P_CTAS == 2
    tasp = _first_exchange("tasp", 4)  # to and from each of 3 peers
    assert len({op.peer for op in tasp.ops}) == 3
    assert tiled.held_by(tasp) == 3 * NCCL_P2P_CTAS
    big = _first_exchange("tasp", 16)  # 15 peers: 30 channels asked for, the pool's 16 run
    assert tiled.held_by(big) == NCCL_P2P_CHANNELS == 16
    assert FlopsCompute(989.0, 0.5).held_by(big) == 1  # no SMs: one exchange, not slowed


def test_a_block_under_an_all_to_all_step_loses_the_pool():
    # TASP's forward on 16 ranks posts two steps of 15 peers each, which run one after the other
    # on its channel, then computes its own block under the first: on 132 - 16 SMs
    from megatron_charm.sim.predict import Problem, predict
    from megatron_charm.sim.topology import Topology

    topo = Topology(1, 16, 300.0, 40.0)
    problem = Problem(1, 16 * 30 * 64, 8, 64)
    tiled = FlopsCompute(989.0, 0.5, sms=132)
    run = predict(topo, problem, tiled, ("tasp",), record=True).methods["tasp"].forward.ranks[0]
    shape = AttnShape(1, problem.seq // 16, 8, 8, 64)
    own = tiled.block_time(Compute(0, 0, Part.FULL, Part.FULL, False), shape, False)
    first = run.timeline[0]
    assert first[1] - first[0] == pytest.approx(own * 132 / (132 - 16), rel=1e-9)


def test_replay_slows_blocks_under_exchanges_only_with_sms():
    import dataclasses

    from megatron_charm.sim.predict import Problem, predict
    from megatron_charm.sim.topology import Topology

    @dataclasses.dataclass(frozen=True)
    class Unslowed(FlopsCompute):
        def slowdown(self, backward: bool, exchanges: int = 1) -> float:
            return 1.0

    topo = Topology(2, 4, 300.0, 40.0)
    problem = Problem(4, 16384, 16, 128)

    def busy(compute):
        ranks = predict(topo, problem, compute, ("ring",)).methods["ring"].forward.ranks
        return sum(r.busy for r in ranks)

    slowed, alone = busy(FlopsCompute(989.0, 0.5, sms=132)), busy(Unslowed(989.0, 0.5, sms=132))
    # ring posts the next kv before each block but the last: those blocks take 132 / 130
    assert 1.0 < slowed / alone <= 132 / 130 + 1e-9
    assert busy(FlopsCompute(989.0, 0.5)) == pytest.approx(busy(Unslowed(989.0, 0.5)))


def test_a_gpu_profile_fits_its_kernels_as_tiles():
    # samples drawn from the tile model (2 us per call, 400 TFLOP/s of a full wave, 132 SMs)
    # over sizes where waves matter: the tiled fit recovers them, the plain one cannot
    from megatron_charm.sim.profile import fit_kernel

    samples = []
    for heads, tokens in ((4, 128), (4, 256), (12, 384), (12, 1024), (16, 2048), (8, 4096)):
        shape = AttnShape(2, tokens, heads, heads, 128)
        fwd = 2e-6 + tiled_flops(FULL, shape, False, 132) / 400e12
        bwd = 2e-6 + 2.5 * tiled_flops(FULL, shape, True, 132) / 200e12
        samples.append(
            {"batch": 2, "heads": heads, "head_dim": 128, "tokens": tokens, "fwd_s": fwd,
             "bwd_s": bwd}
        )  # fmt: skip
    c0, _, c2, worst = fit_kernel(samples, backward=False, sms=132)
    assert c0 == pytest.approx(2e-6, rel=1e-6) and 1 / c2 == pytest.approx(400e12, rel=1e-6)
    assert worst < 1e-6
    b0, _, b2, _ = fit_kernel(samples, backward=True, sms=132)
    assert 1 / b2 == pytest.approx(200e12, rel=1e-6)
    assert fit_kernel(samples, backward=False)[3] > 0.05  # as plain FLOPs the fit misses


def test_fitted_compute_counts_tiles_with_sms():
    from megatron_charm.sim.compute import FittedCompute

    shape = AttnShape(1, 210, 12, 12, 192)
    plain = FittedCompute(fwd_flops_per_s=4e14, bwd_flops_per_s=2e14)
    tiled = FittedCompute(fwd_flops_per_s=4e14, bwd_flops_per_s=2e14, sms=132)
    # plain forward: 406,425,600 FLOPs (4 * 210 * 210 * 12 * 192) at 400 TFLOP/s = 1.016064 us
    assert plain.block_time(FULL, shape, False) == pytest.approx(1.016064e-6)
    # tiled backward: one wave of 132 key tiles of 4 * 64 * 210 * 192 FLOPs = 1,362,493,440,
    # times 2.5 at 200 TFLOP/s = 17.031168 us
    assert tiled.block_time(FULL, shape, True) == pytest.approx(1.7031168e-5)
    with pytest.raises(ValueError, match="sms"):
        FittedCompute(fwd_flops_per_s=1.0, bwd_flops_per_s=1.0, sms=-2)


def test_nvlink_flows_of_one_gpu_share_its_ports():
    from megatron_charm.sim.profile import load_profile
    from megatron_charm.sim.topology import Topology

    topo = Topology(1, 4, 365.0, 40.0, nvlink_egress=450.0)
    assert topo.resources(0, 1) == (("nvl_out", 0), ("nvl_in", 1))
    assert topo.capacity(("nvl_out", 0)) == 450e9
    assert Topology(1, 4, 365.0, 40.0).resources(0, 1) == ()  # no cap: contention-free
    assert Topology(2, 2, 20.0, 10.0, fabric="pcie", nvlink_egress=450.0).resources(0, 1) == (
        ("pcie_out", 0),
        ("pcie_in", 1),
    )
    assert PRESETS["H100"].topology(2, 8).nvlink_egress == 450.0
    assert load_profile("H100").topology(2, 8).nvlink_egress == 450.0
    assert PRESETS["L20"].topology(2, 4).nvlink_egress == 0.0
    with pytest.raises(ValueError, match="nvlink_egress"):
        Topology(1, 2, 1.0, 1.0, nvlink_egress=-1.0)


def test_two_flows_from_one_gpu_split_its_nvlink():
    from megatron_charm.sim.predict import Problem, predict
    from megatron_charm.sim.topology import Topology

    # rm+ sends q and kv at once on one node; with a 450 GB/s cap its transfers take longer
    # (blocks made nearly free so that the transfers decide the time)
    problem = Problem(8, 32768, 16, 128)
    compute = FlopsCompute(1e6, 1.0, mem_bw=1e9)
    free = predict(Topology(1, 8, 365.0, 40.0), problem, compute, ("rm+",)).methods["rm+"]
    capped = predict(
        Topology(1, 8, 365.0, 40.0, nvlink_egress=450.0), problem, compute, ("rm+",)
    ).methods["rm+"]
    assert capped.forward.makespan > free.forward.makespan
    assert capped.backward.makespan > free.backward.makespan
    assert capped.forward.makespan < 2 * free.forward.makespan


# Note [Run of blocks, one call]: tasp's backward step on 2 x 8 at 131,040 tokens, 16 heads of
# 128: q (8,190 tokens) against 15 kv chunks of 546, one kernel call
TASP_SHAPE = AttnShape(1, 8190, 16, 16, 128)


def _tasp_run():
    from megatron_charm.plan.types import Chunk

    return [Compute(0, y, Part.FULL, Chunk(Part.FULL, 0, 15), False) for y in range(1, 16)]


def test_a_run_is_tiled_as_one_call():
    from megatron_charm.sim.compute import run_tiled_flops

    run = _tasp_run()
    # backward tiles keys: each chunk alone is 5 tiles x 16 heads = 80 CTAs, one wave of 132
    apart = sum(tiled_flops(c, TASP_SHAPE, True, 132) for c in run)
    assert apart == pytest.approx(15 * 132 * 4.0 * 128 * 8190 * 128)
    # as one call 8,190 keys: 64 tiles x 16 heads = 1,024 CTAs, 8 waves
    one = run_tiled_flops(run, TASP_SHAPE, True, 132)
    assert one == pytest.approx(8 * 132 * 4.0 * 128 * 8190 * 128)
    assert apart / one == pytest.approx(15 / 8)
    # the forward tiles the queries, which the chunks share: the call costs the blocks' sum
    fwd_apart = sum(tiled_flops(c, TASP_SHAPE, False, 132) for c in run)
    assert run_tiled_flops(run, TASP_SHAPE, False, 132) == pytest.approx(fwd_apart)


def test_models_price_a_run_as_one_call_only_with_sms():
    from megatron_charm.sim.compute import CalibratedCompute, FittedCompute, run_tiled_flops

    run = _tasp_run()
    flops = FlopsCompute(989.0, 0.5, sms=132)
    apart = sum(flops.block_time(c, TASP_SHAPE, True) for c in run)
    one = 2.5 * run_tiled_flops(run, TASP_SHAPE, True, 132) / (989e12 * 0.5)
    assert apart - flops.run_saving(run, TASP_SHAPE, True) == pytest.approx(one)
    fitted = FittedCompute(fwd_flops_per_s=4e14, bwd_flops_per_s=2e14, sms=132, bwd_in_pass=1.5)
    apart = sum(fitted.block_time(c, TASP_SHAPE, True) for c in run)
    one = 1.5 * 2.5 * run_tiled_flops(run, TASP_SHAPE, True, 132) / 2e14
    assert apart - fitted.run_saving(run, TASP_SHAPE, True) == pytest.approx(one)
    # without SMs a run's FLOPs are its blocks' (CPU profiles, flags alone)
    for model in (
        FlopsCompute(989.0, 0.5),
        FittedCompute(fwd_flops_per_s=4e14, bwd_flops_per_s=2e14),
        CalibratedCompute(fwd_block=1e-3, bwd_block=2e-3),
    ):
        assert model.run_saving(run, TASP_SHAPE, True) == 0.0


def test_replay_prices_tasps_backward_steps_as_calls():
    from megatron_charm.plan import PlanOptions
    from megatron_charm.plan.coalesce import coalesced_runs
    from megatron_charm.plan.types import Layout
    from megatron_charm.sim.engine import simulate_pass
    from megatron_charm.sim.programs import programs

    hw = PRESETS["H100"]
    shape, compute = AttnShape(1, 8190, 16, 16, 128), hw.compute_model()
    progs = programs(PlanOptions(method="tasp"), Layout(2, 8), False, "full", shape)
    prog = progs.backward[0]
    runs = coalesced_runs(prog.instrs)
    assert len(runs) == 15  # one call a step
    blocks = [c for c in prog.instrs if isinstance(c, Compute)]
    apart = sum(compute.block_time(c, shape, True) for c in blocks)
    apart -= sum(end - start - 1 for start, end in runs.items()) * compute.call_overhead(True)
    saved = sum(compute.run_saving(list(prog.instrs[s:e]), shape, True) for s, e in runs.items())
    assert saved > 0.4 * apart
    got = simulate_pass(progs, hw.topology(2, 8), shape, compute, True, record=True)
    timeline = got.ranks[0].timeline
    busy = sum(b - a for a, b, label in timeline if label.startswith("C"))
    # each block is slowed by the exchanges in flight when it starts (at most 2x)
    assert apart - saved <= busy <= 2 * (apart - saved)
    assert busy < apart
