"""``cp_attention``: the differentiable entry point (input checks, plan, executor, autograd)."""

from __future__ import annotations

from functools import lru_cache

import torch

from megatron_charm.auto import AUTO, choose_method
from megatron_charm.comm.agreement import CallKey, check_agreement
from megatron_charm.comm.buffers import TensorSpace, final_tensors
from megatron_charm.comm.derived import kept_by
from megatron_charm.comm.executor import ProgramRunner, RunTrace
from megatron_charm.comm.topology import CPTopology
from megatron_charm.kernels import BlockKernel, select_kernel
from megatron_charm.kernels.delta import row_delta
from megatron_charm.plan import (
    METHODS,
    AttnShape,
    Layout,
    Plan,
    PlanOptions,
    check_shape,
    compact_channels,
    plan_levels,
    plan_with_levels,
    rank_plan,
)
from megatron_charm.plan.check_rank import check_rank_program
from megatron_charm.plan.docmask import DocMask, MaskModel
from megatron_charm.plan.layout import ZIGZAG
from megatron_charm.plan.types import Kind, Part, Payload, Program
from megatron_charm.plan.validate import validate
from megatron_charm.sim.profile import Profile

Tensor = torch.Tensor
FORMATS = ("bshd", "sbhd")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def validated_plan(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    shape: AttnShape | None = None,
    pattern: frozenset | None = None,
) -> Plan:
    """The plan for a configuration (``shape`` decides charm's ``cross_level="auto"``; ``pattern``
    prunes it to a mask's non-empty half blocks), replayed by the validator before its first
    use."""
    cross, intra = plan_levels(options, layout, causal, shape)
    return _validated(options, layout, causal, cross, pattern, intra)


# Note [Checking one rank] in megatron_charm.plan.check_rank: up to this CP size every rank
# builds and replays the whole plan at its first call (0.5 s at 32 ranks, 2.5 s at 64 on one
# CPU core, growing with cp_size^2); above it, each rank plans and checks only itself.
FULL_CHECK_MAX_CP = 32


def checked_programs(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cp_rank: int,
    shape: AttnShape | None = None,
    pattern: frozenset | None = None,
) -> tuple[Program, Program]:
    """The forward and backward program of ``cp_rank``, checked before their first use: by the
    full replay of the group's plan (:func:`validated_plan`) up to :data:`FULL_CHECK_MAX_CP`
    ranks and for plans pruned to a mask; above, planned and checked for this rank alone (Note
    [Planning one rank] in :mod:`megatron_charm.plan`)."""
    cross, intra = plan_levels(options, layout, causal, shape)
    if layout.cp_size <= FULL_CHECK_MAX_CP or pattern is not None:
        plan = _validated(options, layout, causal, cross, pattern, intra)
        return plan.forward[cp_rank], plan.backward[cp_rank]
    return _checked_rank(options, layout, causal, cross, cp_rank, intra)


@lru_cache(maxsize=128)
def _checked_rank(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cross: tuple[str, str],
    cp_rank: int,
    intra: tuple[str, str],
) -> tuple[Program, Program]:
    fwd, bwd = rank_plan(options, layout, causal, cross, cp_rank, intra)
    compact = compact_channels(options)
    check_rank_program(fwd, False, causal, options.seq_layout, compact)
    check_rank_program(bwd, True, causal, options.seq_layout, compact)
    return fwd, bwd


@lru_cache(maxsize=128)
def _validated(
    options: PlanOptions,
    layout: Layout,
    causal: bool,
    cross: tuple[str, str],
    pattern: frozenset | None,
    intra: tuple[str, str],
) -> Plan:
    plan = plan_with_levels(options, layout, causal, cross, pattern, intra)
    validate(plan)
    return plan


def _mask_model(
    mask: DocMask | None, options: PlanOptions, topo: CPTopology, s_local: int, causal: bool
) -> MaskModel | None:
    """Resolve ``mask`` for the CP group, refusing what it cannot describe."""
    if mask is None:
        return None
    if not isinstance(mask, DocMask):
        raise ValueError(
            f"mask={mask!r}: expected a megatron_charm.DocMask (document lengths, layout, window)"
        )
    if options.seq_layout != ZIGZAG:
        raise ValueError(
            f"method {options.method!r} schedules the {options.seq_layout} layout, but document "
            "masks describe the zigzag layout; pick a zigzag method (charm, ring, a2a, ...)"
        )
    if s_local % 2 != 0:
        raise ValueError(
            f"a document mask needs an even local sequence length (two zigzag chunks), got "
            f"{s_local}; make the global sequence length divisible by 2 * cp_size"
        )
    if mask.total != s_local * topo.cp_size:
        raise ValueError(
            f"DocMask lengths sum to {mask.total} tokens, but the CP group holds "
            f"{s_local} x {topo.cp_size} = {s_local * topo.cp_size}; the lengths must cover the "
            "global sequence exactly (pad the last document or fix cu_seqlens)"
        )
    return mask.model(topo.cp_size, causal)


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
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}; "
            "pass k and v of one layer, in the same qkv_format"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q, k, v must share the head dim, got {q.shape[-1]} (q) and {k.shape[-1]} (k, v); "
            "check kv_channels / the head dim of the projections"
        )
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"q and k must share batch and local sequence sizes ({qkv_format}), got "
            f"{tuple(q.shape[:2])} and {tuple(k.shape[:2])}; pass all three in the qkv_format "
            "given, each rank's shard of the same sequences"
        )
    if min(q.shape) == 0 or min(k.shape) == 0:
        raise ValueError(
            f"q {tuple(q.shape)} / k {tuple(k.shape)} ({qkv_format}) has an empty dimension; "
            "every rank needs at least one token, batch entry, head and head channel (check "
            "the sequence length, micro-batch size and head counts)"
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


def forward_pass(
    topo: CPTopology,
    program: Program,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kernel: BlockKernel,
    scale: float,
    trace: list[RunTrace] | None = None,
    mask: MaskModel | None = None,
    keep: frozenset[Payload] = frozenset(),
) -> tuple[Tensor, Tensor, dict[Payload, Tensor]]:
    """Run one rank's forward program. ``q [s, b, h, d]``, ``k, v [s, b, h_kv, d]`` (contiguous,
    in the halves order of ``mask`` when one is given); returns ``out [s, b, h, d]`` in q's dtype,
    the float32 ``lse [s, b, h]`` and the received foreign q pieces named in ``keep`` (each
    ``[s_part, b, h, d]``; Note [Keeping foreign queries]: ``kept_pieces`` of the rank's
    backward program), which :func:`backward_pass` takes back."""
    space = TensorSpace(
        AttnShape(q.shape[1], q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.element_size()),
        q.dtype,
        q.device,
    )
    x = topo.cp_rank
    inputs = {(Kind.Q, x, None): (Part.FULL, [q]), (Kind.KV, x, None): (Part.FULL, [k, v])}
    runner = ProgramRunner(topo, program, space, kernel, scale, False, inputs, trace, mask, keep)
    accumulators = runner.run()
    out, lse = final_tensors(accumulators, Kind.O, x, q.dtype)
    return out, lse, runner.kept


def backward_pass(
    topo: CPTopology,
    program: Program,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    kernel: BlockKernel,
    scale: float,
    trace: list[RunTrace] | None = None,
    mask: MaskModel | None = None,
    kept: dict[Payload, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run one rank's backward program with the *final* ``out`` and ``lse`` of its queries
    (shapes as :func:`forward_pass`) and the foreign q pieces its forward ``kept``; returns
    ``dq, dk, dv`` in the input dtypes."""
    space = TensorSpace(
        AttnShape(q.shape[1], q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.element_size()),
        q.dtype,
        q.device,
    )
    x = topo.cp_rank
    inputs = {
        # Note [The backward bundle]: delta in place of out
        (Kind.QB, x, None): (Part.FULL, [q, dout.contiguous(), lse, row_delta(out, dout)]),
        (Kind.KV, x, None): (Part.FULL, [k, v]),
    }
    runner = ProgramRunner(
        topo, program, space, kernel, scale, True, inputs, trace, mask, kept or {}, out
    )
    accumulators = runner.run()
    (dq,) = final_tensors(accumulators, Kind.DQ, x, q.dtype)
    dk, dv = final_tensors(accumulators, Kind.DKV, x, k.dtype)
    return dq, dk, dv


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, topo, programs, kernel, scale, trace, mask):  # q: [s, b, h, d]
        keep = kept_by(programs[1])  # Note [Derived once]
        out, lse, kept = forward_pass(topo, programs[0], q, k, v, kernel, scale, trace, mask, keep)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kept = kept  # received buffers, not part of any graph
        ctx.topo, ctx.backward_program = topo, programs[1]
        ctx.kernel, ctx.scale, ctx.trace = kernel, scale, trace
        ctx.mask = mask
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors  # raises itself on a second backward, unretained
        if ctx.kept is None:
            # the kept pieces are released after the first backward (they are not saved
            # tensors, which retain_graph would keep)
            raise RuntimeError(
                "cp_attention's backward ran twice on one forward, but its plan keeps the "
                "forward's foreign queries for one backward only; set "
                "PlanOptions(foreign_q='resend') (--charm-foreign-q resend) to backward twice"
            )
        dq, dk, dv = backward_pass(
            ctx.topo,
            ctx.backward_program,
            q,
            k,
            v,
            out,
            lse,
            dout,
            ctx.kernel,
            ctx.scale,
            ctx.trace,
            ctx.mask,
            ctx.kept,
        )
        if ctx.kept:
            ctx.kept = None  # released: a second backward would lack them
        return dq, dk, dv, None, None, None, None, None, None


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    topo: CPTopology,
    *,
    method: str | None = None,
    options: PlanOptions | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    qkv_format: str = "bshd",
    return_lse: bool = False,
    kernel: str | BlockKernel | None = None,
    trace: list[RunTrace] | None = None,
    mask: DocMask | None = None,
    profile: Profile | str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Context-parallel attention over ``topo``'s CP group.

    Args:
        q: ``[b, s_local, h, d]`` (``"bshd"``) or ``[s_local, b, h, d]`` (``"sbhd"``).
        k, v: same layout with ``h_kv`` heads, ``h % h_kv == 0`` (GQA/MQA travel at ``h_kv``).
        topo: from :meth:`CPTopology.build`.
        method: shorthand for ``options.method``: ``"charm"`` | ``"rm+"`` | ``"merge"`` |
            ``"ring"`` | ``"all_gather"`` | ``"a2a"`` | ``"a2a+p2p"`` | ``"a2a+charm"`` |
            ``"ring-contig"`` | ``"tasp"``; overrides the method of ``options`` when both are
            given. ``"a2a"`` needs ``h`` and ``h_kv`` divisible by the CP size, ``"a2a+p2p"`` and
            ``"a2a+charm"`` by the ranks per node. ``"auto"`` picks, per new shape, the method the
            simulator predicts fastest on ``profile`` (Note [Choosing a method] in
            :mod:`megatron_charm.auto`).
        options: every scheduling option (:class:`megatron_charm.PlanOptions`); defaults to
            ``PlanOptions()`` (charm with the default settings). All ranks must pass equal options.
        causal: causal attention over the global sequence; the local sequence must then be in the
            zigzag layout (chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``) and even; for
            ``ring-contig``, the contiguous layout (chunk ``cp_rank`` of ``cp_size``).
        softmax_scale: defaults to ``d ** -0.5``.
        return_lse: also return the float32 log-sum-exp ``[b, h, s_local]`` (it has no gradient).
        kernel: block kernel (``"torch"``, ``"flash_attn"``, ``"math"``, or a
            :class:`~megatron_charm.kernels.BlockKernel` of your own); ``None``: by device and
            dtype (:func:`~megatron_charm.kernels.select_kernel`). No environment variable
            changes it: ``MEGATRON_CHARM_KERNEL`` is a default of the trainer and the Megatron
            module only, which pass it here.
        trace: a list that receives one :class:`megatron_charm.comm.executor.RunTrace` per pass
            (forward, then backward): timelines, bytes sent and peak buffer bytes. ``None`` (the
            default) measures nothing.
        mask: documents packed into the global sequence and an optional sliding window
            (:class:`megatron_charm.DocMask`), combined with ``causal``. The plan skips every
            block the mask empties: no compute, no transfer, no merge (Note [Pruning to a mask]).
            With ``layout="thd"`` the local tokens are in Transformer Engine's THD order (every
            sequence's two chunks in turn); with ``"bshd"`` in the zigzag layout.
        profile: with ``method="auto"``: a profile JSON path from ``megatron-charm-sim
            calibrate``, a preset name (``H100``, ``H20``, ``L20``) or a
            :class:`megatron_charm.sim.profile.Profile`.

    Returns:
        ``out`` shaped like ``q`` in q's dtype, or ``(out, lse)``.
    """
    options = options if options is not None else PlanOptions()
    auto = method == AUTO
    if (profile is None) == auto:
        raise ValueError(
            f"method={method!r} with profile={profile!r}: method='auto' needs a profile (a JSON "
            "from `megatron-charm-sim calibrate`, or H100/H20/L20) and no other method takes one"
        )
    if method is not None and not auto and method != options.method:
        options = options.replace(method=method)
    _check_inputs(q, k, v, qkv_format, causal)
    topo.check_device(q.device)
    if qkv_format == "bshd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    # Reordering the tokens below for a mask keeps every dimension, so this is the call's shape.
    shape = AttnShape(q.shape[1], q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.element_size())
    if auto:
        options = options.replace(
            method=choose_method(
                profile, topo.layout, shape, causal, options, topo.groups_per_node
            ).method
        )
    model = _mask_model(mask, options, topo, q.shape[0], causal)
    order = model.local_order(q.shape[0]) if model is not None else None
    if order is not None:
        index = torch.tensor(order, device=q.device)
        q, k, v = (t.index_select(0, index) for t in (q, k, v))
    q, k, v = (t.contiguous() for t in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    fingerprint = mask.fingerprint() if mask is not None else ""
    key = CallKey(
        tuple(q.shape), k.shape[2], str(q.dtype), causal, float(scale), options, fingerprint
    )
    try:
        check_agreement(topo, key)
    except ValueError as err:
        if not auto:
            raise
        name = profile if isinstance(profile, str) else profile.name
        raise ValueError(
            f"{err}. method='auto' picked {options.method!r} from profile {name!r} on this rank: "
            "give every rank the same profile (and the same shapes)"
        ) from None
    check_shape(options, topo.layout, shape)
    x = topo.cp_rank
    if model is None:
        programs = checked_programs(options, topo.layout, causal, x, shape)
    else:
        programs = checked_programs(
            options, topo.layout, model.dense_causal, x, shape, model.pattern
        )
    blk = kernel if isinstance(kernel, BlockKernel) else select_kernel(q.device, q.dtype, kernel)
    with topo.exclusive():
        out, lse = _CPAttention.apply(q, k, v, topo, programs, blk, scale, trace, model)
    if order is not None:
        inverse = torch.empty_like(index)
        inverse[index] = torch.arange(len(order), device=q.device)
        out, lse = out.index_select(0, inverse), lse.index_select(0, inverse)
    if qkv_format == "bshd":
        out = out.transpose(0, 1)
    lse = lse.permute(1, 2, 0)
    return (out, lse) if return_lse else out


__all__ = ["METHODS", "DocMask", "Plan", "PlanOptions", "cp_attention"]
