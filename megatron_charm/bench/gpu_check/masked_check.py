"""The ``masked`` check of the one-GPU check: masked blocks (documents, windows, THD padding) on
the device against float64 on the CPU. On CUDA in bf16 the blocks run FlashAttention-2's varlen
mode (Note [Varlen spans]), which no CPU run can execute; on CPU the span path runs."""

from __future__ import annotations

import torch

from megatron_charm.kernels import select_kernel
from megatron_charm.kernels.backends import _KERNELS
from megatron_charm.kernels.masked import masked_backward, masked_forward
from megatron_charm.plan.docmask import DocMask
from megatron_charm.plan.types import Part

#: (name, mask, causal) for a CP group of 4 with ``s_local`` tokens per rank.
CP = 4


def _masks(s_local: int) -> list[tuple[str, DocMask, bool]]:
    total = CP * s_local
    third = total // 3
    docs = (third, total - 2 * third - 5, third, 5)
    unit = 2 * CP
    padded = (unit * (total // unit // 2), total - unit * (total // unit // 2))
    return [
        ("documents", DocMask(docs), True),
        ("documents+window", DocMask(docs, window=(s_local // 3, -1)), True),
        ("window, full", DocMask((total,), window=(s_local // 4, s_local // 4)), False),
        ("thd+padding", DocMask(padded, "thd", (padded[0] - 3, padded[1] // 2)), True),
    ]


BLOCKS = (
    (1, Part.FULL, 1, Part.FULL),
    (2, Part.FULL, 0, Part.FIRST),
    (0, Part.SECOND, 3, Part.FULL),
    (3, Part.FULL, 2, Part.FULL),
)


def masked_check(device: torch.device, s_local: int) -> tuple[dict, list]:
    """Max errors of out, lse, dq, dk, dv per mask (bf16 and fp32) against float64, relative to
    the reference's largest value (lse: absolute)."""
    rows, failures = [], []
    math = _KERNELS["math"]
    g = torch.Generator().manual_seed(5)
    for name, mask, causal in _masks(s_local):
        model = mask.model(CP, causal)
        for dtype in (torch.bfloat16, torch.float32):
            kern = select_kernel(device, dtype)
            worst = [0.0] * 5
            blocks = 0
            for x, qp, y, kp in BLOCKS:
                spans = model.spans(x, qp, y, kp, s_local // 2)
                if not spans:
                    continue
                blocks += 1
                q_len = s_local if qp == Part.FULL else s_local // 2
                k_len = s_local if kp == Part.FULL else s_local // 2
                # rounded to the dtype first: the reference sees the kernel's own inputs
                q, k, v, do = (
                    torch.randn(n, 2, heads, 64, generator=g).to(dtype).float()
                    for n, heads in ((q_len, 8), (k_len, 2), (k_len, 2), (q_len, 8))
                )
                ref_o, ref_l = masked_forward(math, *(t.double() for t in (q, k, v)), spans, 0.125)
                keys = torch.isfinite(ref_l)
                lse_b = torch.where(keys, ref_l, torch.zeros_like(ref_l)).float()
                ref_g = masked_backward(
                    math, *(t.double() for t in (do, q, k, v, ref_o)), lse_b.double(), spans, 0.125
                )
                dev = [t.to(device, dtype) for t in (q, k, v, do)]
                out, lse = masked_forward(kern, *dev[:3], spans, 0.125)
                grads = masked_backward(
                    kern, dev[3], *dev[:3], ref_o.to(device, dtype), lse_b.to(device), spans, 0.125
                )
                if not torch.equal(torch.isfinite(lse.cpu()), keys):
                    failures.append(f"masked {name} {dtype}: rows without keys are not -inf")
                # errors relative to the reference's largest value (at least 1); lse absolute
                pairs = [(out, ref_o), *zip(grads, ref_g, strict=True)]
                errs = [
                    (a.cpu().double() - b).abs().max().item() / max(1.0, b.abs().max().item())
                    for a, b in pairs
                ]
                errs.insert(1, (lse.cpu().double() - ref_l)[keys].abs().max().item())
                worst = [max(a, b) for a, b in zip(worst, errs, strict=True)]
            # bf16: a few roundings (eps 2^-8 relative); fp32: accumulation order
            bound = 1.6e-2 if dtype == torch.bfloat16 else 1e-5
            ok = max(worst) <= bound
            rows.append(
                {
                    "mask": name,
                    "dtype": str(dtype),
                    "kernel": kern.name,
                    "blocks": blocks,
                    "max_err": dict(zip(("out", "lse", "dq", "dk", "dv"), worst, strict=True)),
                    "ok": ok,
                }  # fmt: skip
            )
            if not ok:
                failures.append(f"masked {name} {dtype}: max error {max(worst):.2e} > {bound}")
    varlen = device.type == "cuda"
    return {"rows": rows, "varlen": varlen, "s_local": s_local}, failures
