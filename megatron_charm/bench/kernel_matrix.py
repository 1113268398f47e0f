"""The block-kernel matrix of the one-GPU check, runnable on CPU kernels too.

For each kernel, dtype, (heads, kv heads), head dim and block shape, on non-contiguous slices:

* **forward**: the whole block's ``out`` and ``lse`` against float64 math;
* **merged backward**: kv split in two, each part's forward merged with
  :func:`~megatron_charm.kernels.merge.merge_partial`, then every part's backward run with the
  *merged* out/lse and the gradients summed, against float64 math. The causal block does what CP
  does: the second half of the queries against the first half of kv (full) and the second half
  (causal).

Tolerances: twice SDPA's own error against float64 on the same inputs (per tensor: out, dq, dk,
dv) plus one unit in the last place at the reference's mean magnitude; ``lse`` (float32 in every
kernel) gets a fixed ``1e-3``, since SDPA does not return it. No check compares a kernel with
itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from megatron_charm.kernels.backends import BlockKernel
from megatron_charm.kernels.delta import out_for_delta, row_delta
from megatron_charm.kernels.math_kernel import math_backward, math_forward
from megatron_charm.kernels.merge import merge_partial

Tensor = torch.Tensor
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BLOCKS = ("causal", "full", "half_kv", "half_q")
LSE_TOL = 1e-3


@dataclass
class MatrixConfig:
    """The matrix's axes and sizes (``seq`` is the block's long side)."""

    seq: int = 1024
    batch: int = 2
    dtypes: tuple[str, ...] = ("bf16", "fp16", "fp32")
    heads: tuple[tuple[int, int], ...] = ((16, 16), (16, 4), (16, 1))
    head_dims: tuple[int, ...] = (64, 128)
    blocks: tuple[str, ...] = BLOCKS
    seed: int = 0


def block_shape(block: str, s: int) -> tuple[int, int, bool]:
    """``(s_q, s_k, causal)`` of a block kind."""
    return {
        "causal": (s, s, True),
        "full": (s, s, False),
        "half_kv": (s, s // 2, False),
        "half_q": (s // 2, s, False),
    }[block]


def _strided(s: int, b: int, h: int, d: int, dtype, device, gen) -> Tensor:
    """``[s, b, h, d]`` that is a strided view (every other position, batch offset by one)."""
    big = torch.randn(2 * s, b + 1, h, d, generator=gen, device="cpu").to(
        device=device, dtype=dtype
    )
    return big[::2, 1:]


def _err(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _sdpa_errors(q, k, v, do, causal, scale, ref) -> list[float]:
    """SDPA's error (out, dq, dk, dv) against float64 on the same inputs, in their dtype."""
    qs, ks, vs = (t.permute(1, 2, 0, 3).detach().clone().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=True)
    o.backward(do.permute(1, 2, 0, 3))
    got = [o.permute(2, 0, 1, 3), *(t.grad.permute(2, 0, 1, 3) for t in (qs, ks, vs))]
    return [_err(g, r) for g, r in zip(got, ref, strict=True)]


def _merged(kern: BlockKernel, q, k, v, do, causal, scale):
    """Split kv in two, merge the forwards, run each part's backward with the merged lse and the
    stand-in for the merged out."""
    s_q, s_k = q.shape[0], k.shape[0]
    if causal:
        rows = slice(s_q // 2, s_q)
        parts = [(slice(0, s_k // 2), False), (slice(s_k // 2, s_k), True)]
    else:
        rows = slice(0, s_q)
        parts = [(slice(0, s_k // 2), False), (slice(s_k // 2, s_k), False)]
    qq, dd = q[rows], do[rows]
    acc_o = acc_l = None
    for sl, c in parts:
        o, lse = kern.forward(qq, k[sl], v[sl], c, scale)
        if acc_o is None:
            acc_o, acc_l = o.float().clone(), lse.float().clone()
        else:
            merge_partial(acc_o, acc_l, o, lse)
    out = acc_o.to(q.dtype)
    dq = torch.zeros(qq.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    # the backward gets what the executor gives it: the stand-in for out built from delta (Note
    # [The backward bundle]), so every cell checks that the kernel reads out only through delta
    stand_in = out_for_delta(dd, row_delta(out, dd))
    for sl, c in parts:
        gq, gk, gv = kern.backward(dd, qq, k[sl], v[sl], stand_in, acc_l, c, scale)
        dq += gq.float()
        dk[sl] += gk.float()
        dv[sl] += gv.float()
    return rows, out, acc_l, (dq, dk, dv)


def check_combo(
    kern: BlockKernel,
    dtype: torch.dtype,
    h: int,
    h_kv: int,
    d: int,
    block: str,
    cfg: MatrixConfig,
    device: torch.device,
) -> dict:
    """One cell of the matrix: errors, tolerances and ``ok``."""
    gen = torch.Generator().manual_seed(cfg.seed)
    s_q, s_k, causal = block_shape(block, cfg.seq)
    q, do = (_strided(s_q, cfg.batch, h, d, dtype, device, gen) for _ in range(2))
    k, v = (_strided(s_k, cfg.batch, h_kv, d, dtype, device, gen) for _ in range(2))
    scale = d**-0.5
    ref_o, ref_l = math_forward(q.double(), k.double(), v.double(), causal, scale)
    ref_g = math_backward(
        do.double(), q.double(), k.double(), v.double(), ref_o, ref_l, causal, scale
    )
    sdpa = _sdpa_errors(q, k, v, do, causal, scale, [ref_o, *ref_g])
    ulp = torch.finfo(dtype).eps
    tols = [2 * e + ulp * r.abs().mean().item() for e, r in zip(sdpa, [ref_o, *ref_g], strict=True)]

    o, lse = kern.forward(q, k, v, causal, scale)
    errs = {"out": _err(o, ref_o), "lse": _err(lse, ref_l)}
    rows, m_o, m_l, grads = _merged(kern, q, k, v, do, causal, scale)
    if causal:  # the reference for the second half of the queries only
        do_half = do.double().clone()
        do_half[: rows.start] = 0
        ref_g = math_backward(
            do_half, q.double(), k.double(), v.double(), ref_o, ref_l, True, scale
        )
    errs["merged_out"] = _err(m_o, ref_o[rows])
    errs["merged_lse"] = _err(m_l, ref_l[rows])
    for name, g, r in zip(("dq", "dk", "dv"), grads, (ref_g[0][rows], *ref_g[1:]), strict=True):
        errs[name] = _err(g, r)
    # dq is the sum of one backward call per kv part, so its budget holds two calls' errors (a
    # float32 half_kv cell on an AVX512 CPU: 1.46e-6 against SDPA's 6.2e-7); so does the merged
    # out, two rounded partials merged and rounded again (a bfloat16 half_kv cell with one kv
    # head, head dim 64, 64 tokens: 0.0122 against SDPA's 0.00463); dk and dv come from one call
    # each
    limit = {
        "out": tols[0], "lse": LSE_TOL, "merged_out": tols[0] + 2 * sdpa[0], "merged_lse": LSE_TOL,
        "dq": tols[1] + 2 * sdpa[1], "dk": tols[2], "dv": tols[3],
    }  # fmt: skip
    bad = sorted(n for n, e in errs.items() if not e <= limit[n])  # NaN fails too
    return {
        "kernel": kern.name, "dtype": str(dtype).replace("torch.", ""), "heads": [h, h_kv],
        "head_dim": d, "block": block, "shape_q_k": [s_q, s_k],
        "errors": {n: float(f"{e:.3g}") for n, e in errs.items()},
        "tolerances": {n: float(f"{t:.3g}") for n, t in limit.items()},
        "sdpa_errors": [float(f"{e:.3g}") for e in sdpa], "ok": not bad, "failed": bad,
    }  # fmt: skip


def run_matrix(
    kernels: list[BlockKernel],
    cfg: MatrixConfig,
    device: torch.device,
    save: Callable[[list], None],
) -> list[dict]:
    """Every cell for every kernel; ``save(rows)`` after each, so a partial run still reports."""
    rows: list[dict] = []
    axes = itertools.product(kernels, cfg.dtypes, cfg.heads, cfg.head_dims, cfg.blocks)
    for kern, dt, (h, h_kv), d, block in axes:
        try:
            row = check_combo(kern, DTYPES[dt], h, h_kv, d, block, cfg, device)
        except Exception as exc:  # noqa: BLE001 - a crash is a failed cell, reported with the rest
            row = {
                "kernel": kern.name, "dtype": dt, "heads": [h, h_kv], "head_dim": d,
                "block": block, "ok": False, "failed": [f"{type(exc).__name__}: {exc}"],
            }  # fmt: skip
        rows.append(row)
        save(rows)
    return rows
