"""Our flash-attn adapter through each supported version's real Python interface (see
:mod:`tests.contract.flash_attn_sources`), and the selection's handling of broken installs."""

from __future__ import annotations

import importlib
import importlib.util
import types
import warnings

import pytest
import torch

from megatron_charm.kernels import flash_attn_kernel, select_kernel
from megatron_charm.kernels.flash_attn_kernel import FlashAttnInterface, load_flash_attn
from megatron_charm.kernels.math_kernel import math_backward, math_forward
from tests.contract import flash_attn_sources as src


@pytest.fixture(scope="module", params=src.VERSIONS)
def flash_version(request):
    try:
        return request.param, src.interface_module(request.param)
    except src.SourceUnavailable as exc:
        pytest.skip(f"flash-attn {request.param} sources unavailable (no PyPI access?): {exc}")


def _blocks(s_q, s_k, h, h_kv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def mk(s, heads):
        return torch.randn(2 * s, 3, heads, d, generator=g).to(dtype)[::2, 1:]

    return mk(s_q, h), mk(s_k, h_kv), mk(s_k, h_kv), mk(s_q, h)


def test_signature_form_is_inspected(flash_version):
    version, (mod, _) = flash_version
    iface = FlashAttnInterface.from_module(mod, version)
    # 2.6 passes window_size=(l, r); 2.7 and 2.8 split it. Read from the signature, checked here
    # against what each release is known to have.
    assert iface.window_form == ("tuple" if version.startswith("2.6") else "split")
    assert iface.softcap


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "s_q,s_k,causal,h,h_kv,d",
    [
        (8, 8, True, 4, 4, 16),
        (8, 4, False, 4, 2, 20),
        (4, 8, False, 4, 1, 64),
        (8, 8, True, 4, 1, 12),
    ],
)
def test_adapter_through_real_interface(flash_version, dtype, s_q, s_k, causal, h, h_kv, d):
    version, (mod, fake) = flash_version
    iface = FlashAttnInterface.from_module(mod, version)
    q, k, v, do = _blocks(s_q, s_k, h, h_kv, d, dtype)
    scale = d**-0.5
    n_calls = len(fake.calls)
    out, lse = iface.forward(q, k, v, causal, scale)
    ref_o, ref_l = math_forward(q, k, v, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == q.shape[:3]
    torch.testing.assert_close(out, ref_o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_l, atol=1e-5, rtol=1e-5)
    grads = iface.backward(do, q, k, v, ref_o, ref_l, causal, scale)
    want = math_backward(do, q, k, v, ref_o, ref_l, causal, scale)
    for g, w, t in zip(grads, want, (q, k, v), strict=True):
        assert g.shape == t.shape and g.dtype == dtype  # GQA: dk, dv at h_kv heads
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    assert fake.calls[n_calls:] == ["fwd", "bwd"]  # the extension really ran


def test_wrong_call_form_fails_against_real_interface(flash_version):
    """The fake extension catches a drifted call: the other release's window keywords."""
    version, (mod, _) = flash_version
    iface = FlashAttnInterface.from_module(mod, version)
    wrong = "split" if iface.window_form == "tuple" else "tuple"
    bad = FlashAttnInterface(iface.forward_fn, iface.backward_fn, wrong, True, version)
    q, k, v, _ = _blocks(8, 8, 2, 2, 16, torch.bfloat16)
    with pytest.raises((TypeError, RuntimeError)):
        bad.forward(q, k, v, True, 0.25)


def test_unknown_signature_is_refused_at_selection():
    def fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
            sink_tokens, return_softmax):  # fmt: skip
        raise AssertionError("must not be called")

    mod = types.SimpleNamespace(_flash_attn_forward=fwd, _flash_attn_backward=fwd)
    with pytest.raises(ValueError, match="sink_tokens"):
        FlashAttnInterface.from_module(mod, "9.9")


def test_head_dim_over_256_is_refused(flash_version):
    version, (mod, _) = flash_version
    iface = FlashAttnInterface.from_module(mod, version)
    q = torch.zeros(2, 1, 1, 264, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim=264"):
        iface.forward(q, q, q, False, 0.1)


@pytest.fixture
def broken_flash_attn(monkeypatch):
    """flash-attn that ``find_spec`` finds but whose import fails (wrong torch ABI)."""
    real_find, real_import = importlib.util.find_spec, importlib.import_module

    def find_spec(name, *a, **kw):
        return object() if name == "flash_attn" else real_find(name, *a, **kw)

    def import_module(name, *a, **kw):
        if name.startswith("flash_attn"):
            raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(flash_attn_kernel.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(flash_attn_kernel.importlib, "import_module", import_module)
    load_flash_attn.cache_clear()
    yield
    load_flash_attn.cache_clear()


def test_broken_install_falls_back_with_one_warning(broken_flash_attn):
    cuda = torch.device("cuda")  # selection reads the device type only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert select_kernel(cuda, torch.bfloat16).name == "torch"
        assert select_kernel(cuda, torch.float16).name == "torch"
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "undefined symbol" in msgs[0] and "torch block kernel" in msgs[0]
    with pytest.raises(ValueError, match="cannot be used"):
        select_kernel(cuda, torch.bfloat16, "flash_attn")


def test_cpu_selection_never_imports_flash_attn(broken_flash_attn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_kernel(torch.device("cpu"), torch.bfloat16).name == "torch"
