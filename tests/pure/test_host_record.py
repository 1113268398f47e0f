"""The host record that benchmark results and calibrate profiles carry, and its comparison."""

from __future__ import annotations

import os

from megatron_charm.bench.provenance import ISA_FLAGS, host, host_differences


def test_the_host_record_names_this_machine() -> None:
    rec = host()
    assert set(rec) == {"cpu", "cores", "isa", "torch", "gpu"}
    assert rec["cores"] == os.cpu_count()
    if os.path.exists("/proc/cpuinfo"):
        assert rec["cpu"] and rec["isa"] is not None and set(rec["isa"]) <= set(ISA_FLAGS)
        with open("/proc/cpuinfo") as fh:
            flags = next(line for line in fh if line.startswith("flags")).split()
        assert rec["isa"] == [f for f in ISA_FLAGS if f in flags]
    assert (
        rec["torch"] and rec["torch"].split("+")[0] == __import__("torch").__version__.split("+")[0]
    )


def test_host_differences_name_what_differs() -> None:
    a = {"cpu": "X", "cores": 2, "isa": ["avx2", "avx512f"], "torch": "2.13.0", "gpu": None}
    assert host_differences(a, dict(a)) == []
    b = dict(a, isa=["avx2"], gpu="H100")  # a None on one side is not compared
    assert host_differences(a, b) == ["isa: ['avx2', 'avx512f'] vs ['avx2']"]
    assert host_differences(a, dict(a, cores=16, torch="2.9.0")) == [
        "cores: 2 vs 16",
        "torch: 2.13.0 vs 2.9.0",
    ]
    assert host_differences(None, a) == host_differences(a, {}) == ["not recorded"]
