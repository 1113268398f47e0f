"""``cp_attention``: the differentiable entry point (input checks, plan, executor, autograd)."""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.distributed as dist

from megatron_charm.comm.buffers import Dims
from megatron_charm.comm.executor import DistributedError, ProgramRunner
from megatron_charm.comm.topology import CPTopology
from megatron_charm.kernels import BlockKernel, select_kernel
from megatron_charm.plan import METHODS, Layout, Plan, build_plan, check_method
from megatron_charm.plan.types import Kind, Part
from megatron_charm.plan.validate import validate

Tensor = torch.Tensor
FORMATS = ("bshd", "sbhd")
COMPACT_ENV = "MEGATRON_CHARM_COMPACT_CROSS"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@lru_cache(maxsize=128)
def validated_plan(
    method: str,
    layout: Layout,
    causal: bool,
    window: int = 2,
    combine_two_nodes: bool = False,
    compact_cross: bool = False,
):
    """The plan for a configuration, replayed by the validator before first use.

    Returns ``(plan, fwd_raw, bwd_raw)``: the raw maps say which partials travel in the input dtype.
    """
    plan = build_plan(method, layout, causal, window, combine_two_nodes, compact_cross)
    fwd, bwd = validate(plan)
    return plan, fwd.raw, bwd.raw


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, qkv_format: str, causal: bool) -> None:
    if qkv_format not in FORMATS:
        raise ValueError(
            f"unknown qkv_format {qkv_format!r}; expected one of {FORMATS} (set qkv_format=)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; expected 4 dims ({qkv_format}: "
                f"{'[b, s, h, d]' if qkv_format == 'bshd' else '[s, b, h, d]'})"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one"
        )
    if q.dtype not in DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}; move them"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q, k, v must share the head dim, got {q.shape[-1]} (q) and {k.shape[-1]} (k, v)"
        )
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"q and k must share batch and local sequence sizes ({qkv_format}), got "
            f"{tuple(q.shape[:2])} and {tuple(k.shape[:2])}"
        )
    h, h_kv = q.shape[2], k.shape[2]
    if h % h_kv != 0:
        raise ValueError(
            f"query heads ({h}) must be a multiple of kv heads ({h_kv}) (h % h_kv == 0); "
            "change num_query_groups / the kv head count"
        )
    s_local = q.shape[1] if qkv_format == "bshd" else q.shape[0]
    if causal and s_local % 2 != 0:
        raise ValueError(
            f"causal CP attention needs an even local sequence length (two zigzag chunks), got "
            f"{s_local}; make the global sequence length divisible by 2 * cp_size"
        )


def _check_shapes_agree(topo: CPTopology, key: tuple) -> None:
    """Once per local shape: all CP ranks must use the same shapes and settings."""
    if key in topo.checked_shapes or topo.cp_size == 1:
        return
    got: list = [None] * topo.cp_size
    try:
        dist.all_gather_object(got, key, group=topo.cp_group)
    except RuntimeError as exc:
        raise DistributedError(
            f"cp_rank {topo.cp_rank} could not agree on shapes with its CP group: {exc}. A peer "
            "rank died or timed out"
        ) from exc
    if len(set(got)) != 1:
        raise ValueError(
            "CP ranks call cp_attention with different local shapes or settings "
            f"(cp_rank: (shape, h_kv, dtype, method, causal)): {dict(enumerate(got))}; every "
            "rank of the CP group must hold the same local sequence length and configuration"
        )
    topo.checked_shapes.add(key)


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, topo, plan_info, kernel, scale):  # q, k, v: [s, b, h(_kv), d]
        plan, fwd_raw, _ = plan_info
        dims = Dims(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype, q.device)
        x = topo.cp_rank
        held = {(Kind.Q, x): (Part.FULL, [q]), (Kind.KV, x): (Part.FULL, [k, v])}
        runner = ProgramRunner(topo, plan.forward[x], fwd_raw, dims, kernel, scale, False, held)
        accs = runner.run()
        acc = accs[(Kind.O, x)]
        out32, lse = acc.tensors if not acc.raw else (acc.tensors[0].float(), acc.tensors[1])
        out = out32.to(q.dtype)
        lse = lse.contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.topo, ctx.plan_info, ctx.kernel, ctx.scale, ctx.dims = (
            topo,
            plan_info,
            kernel,
            scale,
            dims,
        )
        ctx.stats = runner.stats
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, _, bwd_raw = ctx.plan_info
        topo, x = ctx.topo, ctx.topo.cp_rank
        dout = dout.contiguous()
        held = {(Kind.QB, x): (Part.FULL, [q, out, dout, lse]), (Kind.KV, x): (Part.FULL, [k, v])}
        runner = ProgramRunner(
            topo, plan.backward[x], bwd_raw, ctx.dims, ctx.kernel, ctx.scale, True, held
        )
        accs = runner.run()
        dq = accs[(Kind.DQ, x)].tensors[0].to(q.dtype)
        dk, dv = (t.to(k.dtype) for t in accs[(Kind.DKV, x)].tensors)
        return dq, dk, dv, None, None, None, None


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    topo: CPTopology,
    *,
    method: str = "charm",
    causal: bool = True,
    softmax_scale: float | None = None,
    qkv_format: str = "bshd",
    return_lse: bool = False,
    kernel: str | None = None,
    window: int = 2,
    combine_two_nodes: bool = False,
    compact_cross: bool | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Context-parallel attention over ``topo``'s CP group.

    Args:
        q: ``[b, s_local, h, d]`` (``"bshd"``) or ``[s_local, b, h, d]`` (``"sbhd"``).
        k, v: same layout with ``h_kv`` heads, ``h % h_kv == 0`` (GQA/MQA travel at ``h_kv``).
        topo: from :meth:`CPTopology.build`.
        method: ``"charm"`` | ``"rm+"`` | ``"merge"`` | ``"ring"``.
        causal: causal attention over the global sequence; the local sequence must then be in the
            zigzag layout (chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``) and even.
        softmax_scale: defaults to ``d ** -0.5``.
        return_lse: also return the float32 log-sum-exp ``[b, h, s_local]``.
        kernel: block kernel (``"torch"``, ``"flash_attn"``, ``"math"``); default by device/dtype.
        window: exchanges in flight per channel (merge, rm+, charm).
        combine_two_nodes: charm on two nodes only: run own and foreign q in one pipeline
            (paper Algorithm 2) instead of the default split foreign rounds.
        compact_cross: charm: send node-merged results back across nodes in the input dtype
            instead of float32 (half the return bytes on the slow link, one more rounding).
            ``None`` reads ``MEGATRON_CHARM_COMPACT_CROSS`` (``1`` enables it), so that it can be
            chosen without code changes under Megatron.

    Returns:
        ``out`` shaped like ``q`` in q's dtype, or ``(out, lse)``.
    """
    check_method(method)
    if compact_cross is None:
        compact_cross = os.environ.get(COMPACT_ENV, "0").lower() in ("1", "true", "yes")
    _check_inputs(q, k, v, qkv_format, causal)
    topo.check_device(q.device)
    if qkv_format == "bshd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    q, k, v = (t.contiguous() for t in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    _check_shapes_agree(
        topo, (tuple(q.shape), k.shape[2], str(q.dtype), method, causal, float(scale))
    )
    layout = topo.layout if method == "charm" else Layout(1, topo.cp_size)
    plan_info = validated_plan(method, layout, causal, window, combine_two_nodes, compact_cross)
    blk: BlockKernel = select_kernel(q.device, q.dtype, kernel)
    out, lse = _CPAttention.apply(q, k, v, topo, plan_info, blk, scale)
    if qkv_format == "bshd":
        out = out.transpose(0, 1)
    lse = lse.permute(1, 2, 0)
    return (out, lse) if return_lse else out


__all__ = ["METHODS", "Plan", "cp_attention"]
