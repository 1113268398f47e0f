"""``megatron_charm.bench.kernel_shapes`` on the CPU kernel: the cells the gpu_check's ``speed``
check records on a GPU."""

import json

import torch

from megatron_charm.bench import kernel_shapes
from megatron_charm.kernels import select_kernel


def test_cell_records_the_shape_and_times():
    kern = select_kernel(torch.device("cpu"), torch.float32, "torch")
    r = kernel_shapes.cell(kern, 32, 2, 2, 16, torch.device("cpu"), iters=2)
    assert (r["s"], r["b"], r["h"], r["d"]) == (32, 2, 2, 16)
    assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwd_host_us"] > 0
    assert r["bwd_host_us"] > 0


def test_cell_rates_from_a_fixed_time(monkeypatch):
    # Every timed call takes 0.0001 ms, so the rates depend on the FLOPs alone. Forward FLOPs of
    # one 32 x 32 block, b=2, h=2, d=16: QK^T and PV, 2 * 2 * s*s*b*h*d = 4 * 1024 * 64 = 262144.
    # fwd: 262144 / 0.0001 ms / 1e9 = 2.62144 -> 2.62 TFLOP/s;
    # bwd: 2.5 (backward FLOPs ratio) * 262144 / 0.0001 / 1e9 = 6.5536 -> 6.55 TFLOP/s.
    monkeypatch.setattr(kernel_shapes, "device_ms", lambda fn, device, iters=10: 0.0001)
    kern = select_kernel(torch.device("cpu"), torch.float32, "torch")
    r = kernel_shapes.cell(kern, 32, 2, 2, 16, torch.device("cpu"), iters=1)
    assert (r["fwd_ms"], r["bwd_ms"]) == (0.0001, 0.0001)
    assert r["fwd_tflops"] == 2.62
    assert r["bwd_tflops"] == 6.55


def test_sweep_skips_large_shapes_and_reports_a_refused_one():
    class Refuses:
        name = "refuses"

        def forward(self, *a):
            raise RuntimeError("head dim 16 is not supported")

    rows = list(
        kernel_shapes.sweep(
            Refuses(), torch.device("cpu"), ("2x16",), (1, 4), (8, 16), iters=1, max_tokens=32
        )
    )
    assert [(r["b"], r["s"]) for r in rows] == [(1, 8), (1, 16), (4, 8)]
    assert all("head dim 16 is not supported" in r["error"] for r in rows)


def test_main_writes_the_rows_and_the_command(tmp_path):
    out = tmp_path / "shapes.json"
    argv = ["--device", "cpu", "--seqs", "8,16", "--batches", "1", "--heads", "2x8"]
    assert kernel_shapes.main([*argv, "--iters", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["s"] for r in report["rows"]] == [8, 16]
    assert report["command"].startswith("python -m megatron_charm.bench.kernel_shapes --device cpu")


def test_gpu_check_grid_holds_table_5_heads():
    heads, batches, seqs = kernel_shapes.GPU_CHECK_GRID
    assert "12x192" in heads and 1 in batches and min(seqs) <= 256
