"""The CUDA varlen path of masked blocks (Note [Varlen spans]), on CPU: every call binds to the
installed torch's ``_flash_attention_forward/backward`` schemas, and through FlashAttention-2's
documented varlen semantics (CPU fakes) the result equals the float64 masked reference."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_charm.kernels import masked, torch_kernel
from megatron_charm.kernels.backends import _KERNELS
from megatron_charm.plan.docmask import DocMask
from megatron_charm.plan.types import Part
from tests.contract import aten_fakes
from tests.contract.schema import RecordingOps, bind


@pytest.fixture
def fake_ops(monkeypatch):
    ops = RecordingOps(aten_fakes.IMPL)
    monkeypatch.setattr(torch_kernel, "_ops", ops)
    monkeypatch.setattr(masked, "VARLEN_DEVICES", frozenset({"cpu"}))
    return ops


def _blocks(seed: int):
    """Spans of random masked blocks (documents, windows, both layouts) with their parts."""
    rng = random.Random(seed)
    n, s_local = 4, 32
    out = []
    for causal in (True, False):
        for window in (None, (5, -1 if causal else 3), (20, -1 if causal else 0)):
            cuts = sorted(rng.sample(range(1, n * s_local), 5))
            lens = tuple(b - a for a, b in zip([0, *cuts], [*cuts, n * s_local], strict=True))
            model = DocMask(lens, window=window).model(n, causal)
            blocks = (
                (1, 1, Part.FULL, Part.FULL),
                (2, 0, Part.FULL, Part.FIRST),
                (0, 3, Part.SECOND, Part.FULL),
                (3, 1, Part.FULL, Part.FULL),
            )
            for x, y, qp, kp in blocks:
                spans = model.spans(x, qp, y, kp, s_local // 2)
                if spans:
                    q_len = s_local if qp == Part.FULL else s_local // 2
                    k_len = s_local if kp == Part.FULL else s_local // 2
                    out.append((spans, q_len, k_len))
    return out


def _inputs(q_len, k_len, h, h_kv, d, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda s, heads: torch.randn(s, 2, heads, d, generator=g).to(torch.bfloat16)  # noqa: E731
    return mk(q_len, h), mk(k_len, h_kv), mk(k_len, h_kv), mk(q_len, h)


@pytest.mark.parametrize("h_kv,d", [(4, 16), (2, 16), (1, 12)])
def test_varlen_matches_the_float64_reference(fake_ops, h_kv, d):
    math = _KERNELS["math"]
    checked = keyless = 0
    for i, (spans, q_len, k_len) in enumerate(_blocks(h_kv * 100 + d)):
        q, k, v, do = _inputs(q_len, k_len, 4, h_kv, d, i)
        out, lse = masked.masked_forward(math, q, k, v, spans, 0.3)  # varlen (fakes)
        ref_o, ref_l = masked.masked_forward(math, *(t.double() for t in (q, k, v)), spans, 0.3)
        keys = torch.isfinite(ref_l)
        assert torch.equal(torch.isfinite(lse), keys), "rows without keys must be -inf"
        assert (lse[~keys] == float("-inf")).all()
        keyless += int((~keys).sum())
        assert (out.double() - ref_o).abs().max() < 2e-2
        assert (lse.double() - ref_l)[keys].abs().max() < 1e-4
        # backward with the reference's final out / lse (as the executor passes them)
        o_f, l_f = ref_o.to(torch.bfloat16), ref_l.float()
        l_f = torch.where(keys, l_f, torch.zeros_like(l_f))  # a whole row is never keyless
        got = masked.masked_backward(math, do, q, k, v, o_f, l_f, spans, 0.3)
        want = masked.masked_backward(
            math, *(t.double() for t in (do, q, k, v, o_f)), l_f, spans, 0.3
        )
        for a, b in zip(got, want, strict=True):
            assert (a.double() - b).abs().max() < 3e-2 * max(1.0, b.abs().max().item())
        checked += 1
    assert checked >= 8 and keyless > 0  # FA2's +inf rows were mapped
    calls = [c for c in fake_ops.calls if c[0].startswith("_flash_attention")]
    assert calls and all(c[1]["cum_seq_q"] is not None for c in calls)
    windows = {(c[1]["window_size_left"], c[1]["window_size_right"]) for c in calls}
    assert len(windows) > 2, windows  # full, causal and band groups all ran
    for name, call in calls:
        schema = getattr(torch.ops.aten, name).default._schema
        args = tuple(call[a.name] for a in schema.arguments if not a.kwarg_only)
        kwargs = {a.name: call[a.name] for a in schema.arguments if a.kwarg_only}
        bind(schema, args, kwargs)


def test_flash_window_of_spans():
    """The window arithmetic of Note [Varlen spans] on hand-made spans."""
    from megatron_charm.kernels.varlen import flash_window
    from megatron_charm.plan.docmask import Span

    assert flash_window(Span(0, 4, 0, 8, "full")) == (False, -1, -1)
    assert flash_window(Span(0, 4, 0, 4, "causal")) == (True, -1, 0)
    # same positions, window of 2 to the left, causal: j - i in [-2, 0]
    assert flash_window(Span(0, 4, 0, 4, "band", 0, -2, 0)) == (False, 2, 0)
    # kv 4 positions earlier than q (shift -4), band [-6, 0]: j - i in [-2, 4] = [0-2, 0+4]
    assert flash_window(Span(0, 4, 0, 4, "band", -4, -6, 0)) == (False, 2, 4)
    # a band entirely to the right of the bottom-right diagonal is no flash window
    assert flash_window(Span(0, 4, 0, 4, "band", -8, 1, 2)) is None
