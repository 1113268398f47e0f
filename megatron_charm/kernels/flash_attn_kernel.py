"""The ``flash_attn`` block kernel: the flash-attn package's private forward/backward functions.

flash-attn changed these functions' keywords between releases (2.6 takes ``window_size=(l, r)``;
2.7 and 2.8 take ``window_size_left`` / ``window_size_right``; ``softcap`` appeared in 2.6) and
their return values (2.6 returns 8 tensors from the forward, 2.7+ returns 4). The call form is
chosen once, from :func:`inspect.signature` of the installed functions, never from a version
string, so an unknown form fails at selection with a message instead of inside a training step.

The private API needs ``head_dim % 8 == 0`` (only the public wrappers pad): this adapter pads q, k,
v, out and dout with zero columns and slices the results, which is exact. flash-attn handles GQA
natively (``k, v`` keep ``h_kv`` heads, ``dk, dv`` come back at ``h_kv``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from megatron_charm.kernels.heads import pad_head_dim

Tensor = torch.Tensor

#: flash-attn's kernels refuse larger heads.
MAX_HEAD_DIM = 256
#: Output tuple length of ``_flash_attn_forward`` -> index of ``softmax_lse`` in it.
_LSE_INDEX = {8: 5, 4: 1}


def _params(fn: Callable) -> dict[str, inspect.Parameter]:
    # 2.7+ wraps the functions with torch.library.custom_op, whose __call__ takes *args; the
    # function it wraps keeps the real signature.
    target = getattr(fn, "_init_fn", fn)
    return dict(inspect.signature(target).parameters)


def _bshd(t: Tensor) -> Tensor:
    return pad_head_dim(t.transpose(0, 1))


@dataclass(frozen=True)
class FlashAttnInterface:
    """flash-attn's ``_flash_attn_forward`` / ``_flash_attn_backward`` and how to call them.

    ``window_form`` is ``"tuple"`` (``window_size=(l, r)``) or ``"split"``
    (``window_size_left``/``window_size_right``); ``softcap`` says whether the functions take it.
    """

    forward_fn: Callable[..., Any]
    backward_fn: Callable[..., Any]
    window_form: str
    softcap: bool
    version: str | None = None

    @classmethod
    def from_module(cls, mod: ModuleType, version: str | None = None) -> FlashAttnInterface:
        """Inspect ``flash_attn.flash_attn_interface`` (or a module with the same two functions).

        Raises:
            ValueError: when the functions' parameters are not a form this adapter knows.
        """
        fwd, bwd = mod._flash_attn_forward, mod._flash_attn_backward
        pf, pb = _params(fwd), _params(bwd)
        forms = []
        for p in (pf, pb):
            if "window_size_left" in p and "window_size_right" in p:
                forms.append("split")
            elif "window_size" in p:
                forms.append("tuple")
            else:
                forms.append("none")
        softcap = "softcap" in pf and "softcap" in pb
        iface = cls(fwd, bwd, forms[0], softcap, version)
        unknown = iface._unknown_required(pf, iface._forward_kwargs_template()) + (
            iface._unknown_required(pb, iface._backward_kwargs_template())
        )
        if forms[0] != forms[1] or forms[0] == "none" or unknown:
            raise ValueError(
                f"flash-attn {version or '(unknown version)'}: _flash_attn_forward{tuple(pf)} / "
                f"_flash_attn_backward{tuple(pb)} is not a call form this adapter supports "
                f"(unknown required parameters: {unknown or 'none'}). Install flash-attn "
                ">=2.6,<2.9 (pip install 'megatron-charm[gpu]') or use kernel='torch'."
            )
        return iface

    @staticmethod
    def _unknown_required(params: dict[str, inspect.Parameter], known: dict[str, Any]) -> list:
        return [
            n
            for n, p in params.items()
            if n not in known and p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]  # fmt: skip

    def _window(self) -> dict[str, Any]:
        if self.window_form == "tuple":
            return {"window_size": (-1, -1)}
        return {"window_size_left": -1, "window_size_right": -1}

    def _extras(self) -> dict[str, Any]:
        return {
            **self._window(),
            **({"softcap": 0.0} if self.softcap else {}),
            "alibi_slopes": None,
        }

    def _forward_kwargs_template(self) -> dict[str, Any]:
        names = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "return_softmax")
        return dict.fromkeys(names) | self._extras()

    def _backward_kwargs_template(self) -> dict[str, Any]:
        names = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p")
        names += ("softmax_scale", "causal", "deterministic", "rng_state")
        return dict.fromkeys(names) | self._extras()

    def describe(self) -> dict[str, Any]:
        """What was selected, for reports: version, window form, softcap."""
        return {"version": self.version, "window_form": self.window_form, "softcap": self.softcap}

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """``q [s_q, b, h, d]``, ``k, v [s_k, b, h_kv, d]`` (fp16/bf16, CUDA) -> ``out`` like q,
        ``lse`` float32 ``[s_q, b, h]``."""
        d = _check_head_dim(q)
        res = self.forward_fn(
            _bshd(q), _bshd(k), _bshd(v),
            dropout_p=0.0, softmax_scale=scale, causal=causal, return_softmax=False,
            **self._extras(),
        )  # fmt: skip
        lse_at = _LSE_INDEX.get(len(res))
        assert lse_at is not None, f"flash-attn forward returned {len(res)} values"
        out, lse = res[0], res[lse_at]  # out [b, s_q, h, d8]; lse [b, h, s_q]
        return out[..., :d].transpose(0, 1), lse.permute(2, 0, 1)

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``dout, q, out [s_q, b, h, d]``, ``k, v [s_k, b, h_kv, d]``, ``lse`` float32
        ``[s_q, b, h]`` (final, merged) -> ``dq [s_q, b, h, d]``, ``dk, dv [s_k, b, h_kv, d]``."""
        d = _check_head_dim(q)
        qq, kk, vv = _bshd(q), _bshd(k), _bshd(v)
        # The outputs must be contiguous: flash-attn writes into them in place.
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (qq, kk, vv))
        self.backward_fn(
            _bshd(dout), qq, kk, vv, _bshd(out), lse.permute(1, 2, 0).contiguous(), dq, dk, dv,
            dropout_p=0.0, softmax_scale=scale, causal=causal,
            # Megatron-LM's --deterministic-mode turns this on; flash-attn's dq then skips atomics.
            deterministic=torch.are_deterministic_algorithms_enabled(),
            rng_state=None, **self._extras(),
        )  # fmt: skip
        return tuple(g[..., :d].transpose(0, 1) for g in (dq, dk, dv))  # type: ignore[return-value]


def _check_head_dim(q: Tensor) -> int:
    d = q.shape[-1]
    if d > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim={d}: flash-attn supports head dimensions up to {MAX_HEAD_DIM}; use "
            "kernel='torch' (cp_attention; Megatron-LM: --charm-kernel torch; the trainer: "
            "parallel.kernel=torch)"
        )
    return d


@functools.cache
def load_flash_attn() -> tuple[FlashAttnInterface | None, str]:
    """Import flash-attn once and inspect it: ``(interface, "")`` or ``(None, why not)``.

    A package that is found but fails to import (e.g. a wheel built for another torch, a missing
    CUDA library) or has an unknown call form gives one ``RuntimeWarning`` with the reason, and
    the caller falls back to the ``torch`` kernel.
    """
    if importlib.util.find_spec("flash_attn") is None:
        return None, "flash-attn is not installed (pip install 'megatron-charm[gpu]')"
    try:
        mod = importlib.import_module("flash_attn.flash_attn_interface")
        version = getattr(importlib.import_module("flash_attn"), "__version__", None)
        return FlashAttnInterface.from_module(mod, version), ""
    except Exception as exc:  # noqa: BLE001 - any import failure means "do not use it"
        reason = (
            f"flash-attn is installed but cannot be used ({type(exc).__name__}: {exc}); falling "
            "back to the torch block kernel. Reinstall flash-attn for this torch/CUDA "
            "(pip install --no-build-isolation 'flash-attn>=2.6,<2.9') or uninstall it to "
            "silence this warning"
        )
        warnings.warn(reason, RuntimeWarning, stacklevel=2)
        return None, reason
