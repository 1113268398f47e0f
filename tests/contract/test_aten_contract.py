"""Every ATen call the kernels make on CUDA, checked on CPU against the op's real schema, on
``meta`` tensors (the ops' own shape/dtype rules) and against float64 math through CPU fakes."""

from __future__ import annotations

import pytest
import torch

from megatron_charm.kernels import select_kernel, torch_kernel
from megatron_charm.kernels.math_kernel import math_backward, math_forward
from tests.contract import aten_fakes
from tests.contract.schema import RecordingOps, bind

CUDA_PATHS = {
    "flash": (torch_kernel.cuda_flash_forward, torch_kernel.cuda_flash_backward, torch.bfloat16),
    "efficient": (
        torch_kernel.cuda_efficient_forward,
        torch_kernel.cuda_efficient_backward,
        torch.float32,
    ),
}


def _blocks(s_q, s_k, h, h_kv, d, dtype, device="cpu", seed=0):
    """Non-contiguous ``[s, b, h, d]`` slices, as the executor hands the kernels."""
    g = torch.Generator().manual_seed(seed)

    def mk(s, heads):
        big = torch.randn(2 * s, 3, heads, d, generator=g).to(dtype)
        return big[::2, 1:].to(device)  # strided along s, offset along b

    return mk(s_q, h), mk(s_k, h_kv), mk(s_k, h_kv), mk(s_q, h)


@pytest.fixture
def fake_ops(monkeypatch):
    ops = RecordingOps(aten_fakes.IMPL)
    monkeypatch.setattr(torch_kernel, "_ops", ops)
    return ops


def test_flash_backward_passes_undefined_cum_seq(fake_ops):
    """Defect: an empty tensor is *defined* and sends ATen down the varlen branch."""
    q, k, v, do = _blocks(8, 8, 4, 2, 16, torch.bfloat16)
    out, lse = torch_kernel.cuda_flash_forward(q, k, v, True, 0.25)
    torch_kernel.cuda_flash_backward(do, q, k, v, out, lse, True, 0.25)
    (name, call), = [c for c in fake_ops.calls if c[0] == "_flash_attention_backward"]  # fmt: skip
    assert call["cum_seq_q"] is None and call["cum_seq_k"] is None
    assert call["rng_state"].dtype == torch.uint64
    # and the same arguments bind to the installed torch's schema
    schema = torch.ops.aten._flash_attention_backward.default._schema
    bind(schema, tuple(call[a.name] for a in schema.arguments if not a.kwarg_only), {})


def test_schema_binding_rejects_drift():
    schema = torch.ops.aten._flash_attention_backward.default._schema
    with pytest.raises(TypeError, match="missing argument"):
        bind(schema, (torch.zeros(1),) * 6, {})
    with pytest.raises(TypeError, match="unknown keyword"):
        bind(schema, (), {"cum_seq": None})


@pytest.mark.parametrize("path", ["flash", "efficient"])
@pytest.mark.parametrize("d", [16, 20])
@pytest.mark.parametrize(
    "s_q,s_k,causal", [(8, 8, True), (8, 8, False), (8, 4, False), (4, 8, False), (40, 40, True)]
)
@pytest.mark.parametrize("h,h_kv", [(4, 4), (4, 2), (4, 1)])
def test_cuda_paths_match_math_through_fakes(fake_ops, path, d, s_q, s_k, causal, h, h_kv):
    fwd, bwd, dtype = CUDA_PATHS[path]
    q, k, v, do = _blocks(s_q, s_k, h, h_kv, d, dtype)
    scale = d**-0.5
    out, lse = fwd(q, k, v, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    ref_o, ref_l = math_forward(q, k, v, causal, scale)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref_o, **tol)
    torch.testing.assert_close(lse, ref_l, atol=1e-5, rtol=1e-5)
    grads = bwd(do, q, k, v, ref_o, ref_l, causal, scale)
    want = math_backward(do, q, k, v, ref_o, ref_l, causal, scale)
    for g, w, t in zip(grads, want, (q, k, v), strict=True):
        assert g.shape == t.shape and g.dtype == dtype
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("path", ["flash", "efficient"])
@pytest.mark.parametrize("h_kv,d", [(4, 64), (1, 20)])
def test_cuda_paths_on_meta_tensors(monkeypatch, path, h_kv, d):
    """The real ops' meta kernels accept our arguments and give the shapes we slice."""
    ops = RecordingOps()  # no fakes: the real op runs, on meta tensors
    monkeypatch.setattr(torch_kernel, "_ops", ops)
    fwd, bwd, dtype = CUDA_PATHS[path]
    q, k, v, do = _blocks(12, 12, 4, h_kv, d, dtype, device="meta")
    out, lse = fwd(q, k, v, True, 0.1)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    grads = bwd(do, q, k, v, out, lse, True, 0.1)
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.shape == t.shape and g.dtype == dtype
    assert len(ops.calls) == 2


def test_cpu_calls_bind_and_use_native_gqa(monkeypatch):
    native = torch_kernel.cpu_native_gqa()  # probe once, before recording
    ops = RecordingOps()
    monkeypatch.setattr(torch_kernel, "_ops", ops)
    q, k, v, do = _blocks(8, 8, 4, 1, 16, torch.float32)
    out, lse = torch_kernel.torch_forward(q, k, v, True, 0.3)
    torch_kernel.torch_backward(do, q, k, v, out, lse, True, 0.3)
    names = [n for n, _ in ops.calls]
    assert names == [
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    ]
    if native:
        # kv reaches the op at h_kv heads: no per-block repeat
        assert all(call["key"].shape[1] == 1 for _, call in ops.calls)


def test_flash_path_keeps_kv_heads(fake_ops):
    q, k, v, _ = _blocks(8, 8, 4, 1, 16, torch.bfloat16)
    torch_kernel.cuda_flash_forward(q, k, v, False, 0.3)
    assert fake_ops.calls[0][1]["key"].shape[2] == 1  # [b, s, h_kv, d]


def test_fp32_on_cuda_uses_an_fp32_kernel_not_float64_math():
    cuda = torch.device("cuda")  # selection needs no GPU: it reads the device type
    assert select_kernel(cuda, torch.float32).name == "torch"
    assert torch_kernel._cuda_path(torch.float32) == "efficient"
    assert select_kernel(cuda, torch.float64).name == "math"
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        select_kernel(cuda, torch.float64, "torch")


def test_native_gqa_flag_tells_callers_when_to_expand_once():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    kern = select_kernel(cuda, torch.bfloat16, "torch")
    assert kern.native_gqa(cuda, torch.bfloat16) and not kern.native_gqa(cuda, torch.float32)
    assert kern.native_gqa(cpu, torch.float32) == torch_kernel.cpu_native_gqa()
    assert not select_kernel(cpu, torch.float64).native_gqa(cpu, torch.float64)
