"""The NUMA node split's NVML calls, run through the real ``pynvml`` over a fake NVML library.

``pynvml`` (from ``nvidia-ml-py``) is pure Python over ctypes; the library it loads needs a
driver. Its functions look up ``nvmlLib.<C function>`` and pass ``byref`` structs, so a fake
``nvmlLib`` object whose methods fill those structs runs every wrapper we call unchanged: a
renamed C entry point, a changed arity or a renamed struct field fails here.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import zipfile

import pytest

from megatron_charm.nodes import numa_domains, probe_gpus
from tests.contract import pypi
from tests.contract.pypi import SourceUnavailable

VERSION = "13.615.71"


def _pynvml():
    dest = pypi.cache_dir() / "nvidia-ml-py" / VERSION
    module = dest / "pynvml.py"
    if not module.is_file():
        pypi.pip_download(f"nvidia-ml-py=={VERSION}", dest, "--only-binary", ":all:")
        wheels = list(dest.glob("nvidia_ml_py-*.whl"))
        if not wheels:
            raise SourceUnavailable(f"pip download nvidia-ml-py=={VERSION} left no wheel")
        with zipfile.ZipFile(wheels[0]) as whl:
            module.write_bytes(whl.read("pynvml.py"))
    spec = importlib.util.spec_from_file_location(f"pynvml_{VERSION.replace('.', '_')}", module)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # pynvml looks itself up there to make its error classes
    spec.loader.exec_module(mod)
    return mod


class FakeNvml:
    """Two sockets of four GPUs; GPUs 0-3 joined by NVLink, 4-7 plain PCIe."""

    def __init__(self, nvml) -> None:
        self.nvml = nvml
        self.bus = [0x10 + i for i in range(8)]
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        raise AttributeError(name)  # an entry point we did not expect: fail loudly

    def _ok(self, name: str) -> int:
        self.calls.append(name)
        return self.nvml.NVML_SUCCESS

    def nvmlInitWithFlags(self, flags) -> int:
        return self._ok("nvmlInitWithFlags")

    def nvmlShutdown(self) -> int:
        return self._ok("nvmlShutdown")

    def nvmlDeviceGetCount_v2(self, count) -> int:
        count._obj.value = 8
        return self._ok("nvmlDeviceGetCount_v2")

    def nvmlDeviceGetHandleByIndex_v2(self, index, device) -> int:
        handle = ctypes.c_void_p(index.value + 1)
        ctypes.memmove(
            ctypes.addressof(device._obj), ctypes.addressof(handle), ctypes.sizeof(handle)
        )
        return self._ok("nvmlDeviceGetHandleByIndex_v2")

    def _index(self, handle) -> int:
        return ctypes.cast(handle, ctypes.c_void_p).value - 1

    def nvmlDeviceGetPciInfo_v3(self, handle, info) -> int:
        info._obj.busId = f"00000000:{self.bus[self._index(handle)]:02X}:00.0".encode()
        return self._ok("nvmlDeviceGetPciInfo_v3")

    def nvmlDeviceGetNvLinkState(self, handle, link, active) -> int:
        i = self._index(handle)
        if (link.value if hasattr(link, "value") else link) >= 4:
            return self.nvml.NVML_ERROR_INVALID_ARGUMENT
        active._obj.value = self.nvml.NVML_FEATURE_ENABLED if i < 4 else 0
        return self._ok("nvmlDeviceGetNvLinkState")

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, handle, link, info) -> int:
        i = self._index(handle)
        link = link.value if hasattr(link, "value") else link
        peer = [j for j in range(4) if j != i][link % 3]
        info._obj.busId = f"00000000:{self.bus[peer]:02X}:00.0".encode()
        return self._ok("nvmlDeviceGetNvLinkRemotePciInfo_v2")


def test_probe_through_the_real_pynvml():
    try:
        nvml = _pynvml()
    except SourceUnavailable as exc:
        pytest.skip(str(exc))
    fake = FakeNvml(nvml)
    nvml.nvmlLib = fake
    nvml._nvmlGetFunctionPointer_cache.clear()
    gpus = probe_gpus(nvml, numa_of=lambda pci: 0 if pci[1] < 0x14 else 1)
    assert [g.pci for g in gpus] == [(0, 0x10 + i, 0) for i in range(8)]
    assert gpus[0].nvlink_peers == frozenset({(0, 0x11, 0), (0, 0x12, 0), (0, 0x13, 0)})
    assert all(not g.nvlink_peers for g in gpus[4:])
    assert [numa_domains(gpus)[g.pci] for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert fake.calls[0] == "nvmlInitWithFlags" and fake.calls[-1] == "nvmlShutdown"
    assert "nvmlDeviceGetNvLinkRemotePciInfo_v2" in fake.calls


def test_cuda_device_pci_reads_what_torch_itself_reads():
    """``cuda_device_pci`` reads ``pci_domain_id``, ``pci_bus_id`` and ``pci_device_id`` of
    ``torch.cuda.get_device_properties``; the CPU build has no ``_CudaDeviceProperties`` to
    inspect, but the installed torch's own NUMA binding reads the same three attributes (and
    spells the sysfs address as we do)."""
    import inspect

    import torch.numa.binding as binding

    from megatron_charm import nodes

    ours = inspect.getsource(nodes.cuda_device_pci)
    theirs = inspect.getsource(binding._get_numa_node_index_for_gpu_index)
    for attribute in ("pci_domain_id", "pci_bus_id", "pci_device_id"):
        assert f"props.{attribute}" in ours
        assert f"device_properties.{attribute}" in theirs
    assert "{domain:04x}:{bus:02x}:{device:02x}.0" in theirs
    assert nodes.format_pci((0, 0xDC, 0)) == "0000:dc:00.0"
