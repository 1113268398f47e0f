"""``megatron-charm-bench memory`` end to end at its smallest shape, and the GQA shape's tensors."""

from __future__ import annotations

import json
import os
import sys

from megatron_charm.bench.__main__ import main
from megatron_charm.bench.memory import SHAPES

LINUX_HWM = sys.platform.startswith("linux") and os.access("/proc/self/clear_refs", os.W_OK)


def test_memory_tiny_runs_and_reports_every_part(tmp_path):
    out, md = tmp_path / "memory.json", tmp_path / "memory.md"
    main(
        [
            "memory",
            "--shapes",
            "tiny",
            "--methods",
            "ring,charm",
            "--json",
            str(out),
            "--md",
            str(md),
        ]
    )
    data = json.loads(out.read_text())
    worst = data["results"]["tiny"]["max_over_ranks"]
    for method in ("ring", "charm"):
        row = worst[method]
        assert 0 < row["fwd_peak"] <= row["peak"], row
        assert row["peak"] == max(row["fwd_peak"], row["saved"] + row["bwd_peak"]), row
        assert row["with_inputs"] > row["peak"], row
        # the process's own high-water mark over the call, less its start (Linux, where the mark
        # can be reset): the call allocates, so it grows; elsewhere there is none
        if LINUX_HWM:
            assert isinstance(row["process_peak"], int) and row["process_peak"] > 0, row
        else:
            assert row["process_peak"] is None, row
    assert "| tiny | 4 | 128 | 4 | 16 | 2 x 2 |" in md.read_text()


def test_shapes_name_their_kv_heads():
    for name, (m, p, _b, seq, h, _d, h_kv) in SHAPES.items():
        assert h % h_kv == 0 and seq % (2 * m * p) == 0, name
    assert SHAPES["gpt350m-gqa"][4] // SHAPES["gpt350m-gqa"][6] == 4
