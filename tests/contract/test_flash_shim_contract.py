"""The benchmark's CPU flash-attn shim takes the parameters of the released flash-attn functions
that ring-flash-attention and yunchang call (its version string claims 2.8.3)."""

from __future__ import annotations

import inspect

import pytest

from megatron_charm.bench import flash_shim
from tests.contract import flash_attn_sources as src

NAMES = (
    "_flash_attn_forward",
    "_flash_attn_backward",
    "_flash_attn_varlen_forward",
    "_flash_attn_varlen_backward",
)


@pytest.mark.parametrize("version", ["2.7.4.post1", "2.8.3"])
def test_shim_parameters_are_flash_attns(version):
    try:
        mod, _ = src.interface_module(version)
    except src.SourceUnavailable as exc:
        pytest.skip(f"flash-attn {version} sources unavailable (no PyPI access?): {exc}")
    for name in NAMES:
        real = getattr(mod, name)
        real = getattr(real, "_init_fn", real)  # torch.library.custom_op wraps the function
        ours = getattr(flash_shim, name)
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(real).parameters
        ), name
    with flash_shim.installed():
        import flash_attn

        assert flash_attn.__version__ == "2.8.3"


def test_shim_refuses_what_it_does_not_compute():
    import torch

    t = torch.zeros(4, 2, 8)
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="zero_tensors"):
        flash_shim._flash_attn_varlen_forward(
            t, t, t, cu, cu, 4, 4, 0.0, 0.5, False, zero_tensors=True
        )
