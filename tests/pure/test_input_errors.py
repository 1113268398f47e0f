"""Bad user input to public helpers raises ``ValueError`` naming the value and the fix, not an
``AssertionError``, ``KeyError`` or ``ZeroDivisionError`` from deep inside."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from megatron_charm.kernels.merge import merge_partial
from megatron_charm.plan.layout import (
    SEQ_LAYOUTS,
    block_parts,
    contiguous_positions,
    sequence_positions,
    zigzag_positions,
)
from megatron_charm.plan.payloads import AttnShape
from megatron_charm.plan.types import Layout
from megatron_charm.sim.profile import preset_profile


def _merge_args(acc: torch.dtype, lse: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (
        torch.zeros(2, 1, 1, 4, dtype=acc),
        torch.zeros(2, 1, 1, dtype=lse),
        torch.zeros(2, 1, 1, 4),
        torch.zeros(2, 1, 1),
    )


@pytest.mark.parametrize(
    ("acc", "lse"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.float64),
    ],
)
def test_merge_partial_rejects_low_precision_or_mixed_accumulators(acc, lse):
    with pytest.raises(ValueError, match=r"out\.dtype=torch\.\w+, lse\.dtype=.*float32/float64"):
        merge_partial(*_merge_args(acc, lse))


def test_merge_partial_accepts_float64_accumulators():
    out, lse, out_b, lse_b = _merge_args(torch.float64, torch.float64)
    merge_partial(out, lse, out_b, lse_b)
    assert torch.allclose(lse, torch.full_like(lse, torch.log(torch.tensor(2.0)).item()))


def test_block_parts_rejects_unknown_seq_layout():
    with pytest.raises(ValueError, match=r"seq_layout='zig-zag'.*'zigzag', 'contiguous'"):
        block_parts(1, 0, True, "zig-zag")
    # every branch checks it, not only the causal off-diagonal one that differs by layout
    with pytest.raises(ValueError, match="unknown sequence layout"):
        block_parts(0, 0, False, "striped")


def test_sequence_positions_rejects_unknown_seq_layout():
    assert SEQ_LAYOUTS == ("zigzag", "contiguous")
    with pytest.raises(ValueError, match=r"sequence_positions\(seq_layout='ZIGZAG'\)"):
        sequence_positions(0, 2, 8, "ZIGZAG")


@pytest.mark.parametrize("positions", [zigzag_positions, contiguous_positions])
def test_positions_reject_bad_rank_or_size(positions):
    with pytest.raises(ValueError, match=r"cp_size=0\): the context-parallel size must be >= 1"):
        positions(0, 0, 8)
    for rank in (-1, 2):
        with pytest.raises(ValueError, match=rf"cp_rank={rank}, cp_size=2\).*0 <= cp_rank"):
            positions(rank, 2, 8)


def test_positions_still_check_divisibility():
    with pytest.raises(ValueError, match="divisible by 2 \\* cp_size = 4"):
        zigzag_positions(0, 2, 6)
    assert contiguous_positions(1, 2, 6) == [3, 4, 5]


@pytest.mark.parametrize(("m", "p"), [(0, 4), (2, 0), (-1, 8), (2.0, 8), (True, 8)])
def test_layout_rejects_non_positive_or_non_int_sizes(m, p):
    with pytest.raises(ValueError, match=rf"Layout\(num_nodes={m!r}, ranks_per_node={p!r}\).*>= 1"):
        Layout(m, p)


@pytest.mark.parametrize(
    ("sizes", "named"),
    [
        ({"b": 0}, "b=0"),
        ({"s_local": 0}, "s_local=0"),
        ({"h": 0, "h_kv": 0}, "h=0, h_kv=0"),
        ({"h_kv": 0}, "h_kv=0"),
        ({"d": -1}, "d=-1"),
        ({"itemsize": 0}, "itemsize=0"),
    ],
)
def test_attn_shape_rejects_non_positive_sizes(sizes, named):
    with pytest.raises(ValueError, match=rf"AttnShape\({named}\): every size must be >= 1"):
        AttnShape(**{"b": 1, "s_local": 8, "h": 8, "h_kv": 2, "d": 16, **sizes})


def test_attn_shape_rejects_heads_not_divisible_by_kv_heads():
    with pytest.raises(
        ValueError, match=r"AttnShape\(h=8, h_kv=3\): query heads must be a multiple"
    ):
        AttnShape(b=1, s_local=8, h=8, h_kv=3, d=16)


def test_preset_profile_rejects_unknown_name_and_lists_presets():
    with pytest.raises(ValueError, match=r"preset_profile\(name='A100'\): unknown preset.*H100"):
        preset_profile("A100")


def test_preset_profile_is_case_insensitive_like_load_profile():
    from megatron_charm.sim.profile import load_profile

    assert preset_profile("h100") == preset_profile("H100") == load_profile("h100")


def test_cli_run_turns_a_hung_command_into_a_failure(monkeypatch):
    from megatron_charm import cli

    def hang(cmd, **kwargs):
        assert kwargs["timeout"] == cli.RUN_TIMEOUT_S
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=b"partial")

    monkeypatch.setattr(cli.subprocess, "run", hang)
    rc, out = cli._run(["git", "rev-parse", "HEAD"], Path("."))
    assert rc == 124 and "timed out after 30 s" in out and out.endswith("partial")
    assert cli.describe_checkout(Path(".")) is None


def test_calibrate_traffic_thread_hands_its_error_to_the_main_thread():
    import threading

    from megatron_charm.sim.calibrate_worker import _TrafficThread

    def fail(n: int) -> None:
        raise RuntimeError(f"send to peer failed after {n} messages")

    worker = _TrafficThread(fail, 3)
    worker.start()
    with pytest.raises(RuntimeError, match="failed after 3 messages"):
        worker.join_or_raise(10.0)

    release = threading.Event()
    stuck = _TrafficThread(release.wait)
    stuck.start()
    try:
        with pytest.raises(TimeoutError, match="still exchanging messages after 0 s.*--timeout"):
            stuck.join_or_raise(0.05)
    finally:
        release.set()
        stuck.join()


def test_zero_kv_heads_are_an_empty_dimension_not_a_division_by_zero() -> None:
    import torch

    from megatron_charm.function import _check_inputs

    q = torch.zeros(1, 4, 2, 8)
    k = torch.zeros(1, 4, 0, 8)
    with pytest.raises(ValueError, match="has an empty dimension"):
        _check_inputs(q, k, k.clone(), "bshd", causal=True)
