"""The CUDA device queries of ``calibrate`` and ``kernel_shapes``, checked against the installed
torch's own interface. A CPU build has no ``_CudaDeviceProperties`` class to inspect, but its
type stub declares the fields every build's class has: a renamed field fails here."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch

import megatron_charm.bench.kernel_shapes as kernel_shapes
import megatron_charm.bench.provenance as provenance
import megatron_charm.sim.calibrate_worker as calibrate_worker


def _device_property_fields() -> dict[str, str]:
    stub = (Path(torch.__file__).parent / "_C" / "__init__.pyi").read_text()
    body = stub.split("class _CudaDeviceProperties:", 1)[1].split("\nclass ", 1)[0]
    return dict(re.findall(r"^\s+(\w+): (\w+)", body, flags=re.M))


def test_calibrate_reads_a_field_the_device_properties_have():
    # calibrate records the SMs a GPU's tiles run in waves over (Note [Tiles and waves])
    source = inspect.getsource(calibrate_worker._measure)
    read = re.findall(r"get_device_properties\(device\)\.(\w+)", source)
    assert read == ["multi_processor_count"]
    assert _device_property_fields()[read[0]] == "_int"
    assert list(inspect.signature(torch.cuda.get_device_properties).parameters) == ["device"]


def test_kernel_shapes_names_the_device_with_the_public_call():
    source = inspect.getsource(kernel_shapes.main)
    assert "torch.cuda.get_device_name()" in source
    params = inspect.signature(torch.cuda.get_device_name).parameters
    assert list(params) == ["device"] and params["device"].default is None


def test_the_host_record_names_the_gpu_with_the_public_calls():
    # results and calibrate profiles record the GPU that auto compares with a rank's
    source = inspect.getsource(provenance.host)
    assert "torch.cuda.is_available()" in source and "torch.cuda.get_device_name(0)" in source
    assert inspect.signature(torch.cuda.is_available).parameters == {}
    params = inspect.signature(torch.cuda.get_device_name).parameters
    assert list(params) == ["device"]
