"""scripts/bench/blocks_in_pass.py: a pass's CPU split, and the replay's charges next to it."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_charm.sim.profile import preset_profile
from tests.bench_scripts import load_bench_script
from tests.sim.test_in_pass import BLOCKS

CFG = {
    "nodes": 2,
    "ranks_per_node": 2,
    "cross_rate": "100mbit",
    "method": "charm",
    "batch": 1,
    "seq_local": 256,
    "heads": 4,
    "kv_heads": 4,
    "head_dim": 64,
    "iters": 3,
    "causal": True,
}


def test_the_measured_split_sums_over_the_ranks() -> None:
    mod = load_bench_script("blocks_in_pass")
    # per rank: process, calling thread, kernel, wall
    got = mod.measured([[0.10, 0.08, 0.06, 0.20], [0.12, 0.09, 0.05, 0.25]])
    assert got == pytest.approx(
        {"process": 0.22, "kernel": 0.11, "thread_rest": 0.06, "transport": 0.05, "wall": 0.25}
    )
    text = mod.markdown(CFG, got, None)
    assert "| measured | 220.0 | 110.0 | 60.0 | 50.0 |" in text
    assert "wall 250.0 ms" in text and "charged" not in text


def test_the_charges_scale_the_blocks_by_the_profiles_factor(tmp_path) -> None:
    mod = load_bench_script("blocks_in_pass")
    base = preset_profile("H100")
    compute = dataclasses.asdict(dataclasses.replace(BLOCKS, fwd_in_pass=1.2, bwd_in_pass=1.2))
    prof = dataclasses.replace(base, compute={"kind": "fitted", **compute, "masked_cost": []})
    path = tmp_path / "p.json"
    prof.save(path)
    got = mod.charged(CFG, str(path))
    assert got["blocks_alone"] > 0
    assert got["blocks"] == pytest.approx(1.2 * got["blocks_alone"])
    assert got["host"] == 0.0 and got["transport"] == 0.0  # the profile charges none
    assert "| charged |" in mod.markdown(CFG, mod.measured([[0.1, 0.1, 0.1, 0.1]]), got)


def test_bad_sizes_are_refused() -> None:
    mod = load_bench_script("blocks_in_pass")
    with pytest.raises(ValueError, match="--kv-heads 3"):
        mod.main(["--heads", "4", "--kv-heads", "3"])
