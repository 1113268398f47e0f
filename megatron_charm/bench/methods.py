"""The attention implementations a benchmark compares, behind one calling convention.

Each :class:`Contender` owns its inputs in its native layout (``sbhd`` for ours, as Megatron
calls it; ``bshd`` for ring-flash-attention and TE), prepared once outside the timed region, and
returns outputs and gradients in ``bshd`` so that they can be compared.

* ``charm``, ``rm+``, ``merge``, ``ring``, ``all_gather``, ``a2a``, ``a2a+p2p``, ``ring-contig``,
  ``tasp``: :func:`megatron_charm.cp_attention`. ``ring-contig`` expects contiguous shards when
  causal: its contender re-shards the zigzag inputs once, before anything is timed, and
  :meth:`comparable` hands its results back in the zigzag layout for the agreement and reference
  checks. ``tasp`` needs ``s_local`` divisible by ``2 * (cp_size - 1)``.
* ``ring-flash``: ring-flash-attention's ``zigzag_ring_flash_attn_func`` (causal) or
  ``ring_flash_attn_func`` (non-causal; the zigzag variant refuses it). On CPU it runs on the
  flash-attn shim of :mod:`megatron_charm.bench.flash_shim`.
* ``ring-flash-llama3``: ring-flash-attention's ``llama3_flash_attn_varlen_func``, the kv
  all-gather of Llama 3 (one kv head at a time, the next head's gather overlapping the current
  head's compute) on the contiguous layout, ``b = 1``; its contender re-shards like
  ``ring-contig``'s. On CPU it runs on the shim's varlen functions.
* ``usp``: yunchang's ``LongContextAttention`` (USP): Ulysses inside each node times
  ring-flash-attention's zigzag ring (``basic`` ring when not causal) across nodes, on yunchang's
  own shard layout (``zigzag_extract_local``); its contender re-shards like ``ring-contig``'s.
  Needs the heads divisible by the ranks per node; on CPU it runs on the flash-attn shim.
* ``te-p2p``: Transformer Engine's ``attn_forward_func_with_cp(cp_comm_type="p2p")``, CUDA only,
  imported lazily.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_charm.comm.topology import CPTopology
from megatron_charm.kernels import BlockKernel
from megatron_charm.plan import PlanOptions, sequence_positions
from megatron_charm.plan.docmask import DocMask
from megatron_charm.plan.options import METHODS, PLAN_KEYS

OURS = METHODS
BASELINES = ("ring-flash", "ring-flash-llama3", "usp", "te-p2p")
Tensor = torch.Tensor


@dataclass
class Inputs:
    """One rank's share of a global problem, in ``bshd``: ``q, dout [b, s_local, h, d]``,
    ``k, v [b, s_local, h_kv, d]`` (zigzag order when causal); ``idx`` the global positions."""

    q: Tensor
    k: Tensor
    v: Tensor
    dout: Tensor
    idx: Tensor


class Contender:
    """Runs one implementation on fixed inputs: :meth:`forward` and :meth:`forward_backward`."""

    name: str

    def __init__(self, name: str, inp: Inputs, causal: bool, scale: float) -> None:
        self.name, self.causal, self.scale = name, causal, scale
        self.inp = inp

    def _call(self) -> Tensor:
        """One call of the implementation on this contender's own inputs."""
        raise NotImplementedError

    def forward(self) -> Tensor:
        """``out [b, s_local, h, d]`` (``bshd``) of one call on this contender's own inputs, in
        its own shard layout (not :meth:`comparable`'s)."""
        raise NotImplementedError

    def forward_backward(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(out, dq, dk, dv)`` in ``bshd``."""
        raise NotImplementedError

    def _autograd(self, q: Tensor, k: Tensor, v: Tensor, dout: Tensor):
        """``(out, dq, dk, dv)`` of one call of ``_call`` on the leaf tensors ``q, k, v``."""
        for t in (q, k, v):
            t.grad = None
        out = self._call()
        out.backward(dout)
        return out, q.grad, k.grad, v.grad

    def comparable(self, results: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """``results`` of :meth:`forward_backward` as rows of this rank's zigzag shard (the
        layout of :class:`Inputs`), to compare with other contenders; never timed."""
        return results


def _whole(t: Tensor, topo: CPTopology, where: list[Tensor]) -> Tensor:
    """The whole sequence ``[b, s_local * n, ...]`` from every rank's shard like ``t``, rank
    ``r``'s holding the global positions ``where[r]``. Collective (an all-gather)."""
    t = t.detach().contiguous()
    shards = [torch.empty_like(t) for _ in range(topo.cp_size)]
    dist.all_gather(shards, t, group=topo.cp_group)
    seq = t.shape[1] * topo.cp_size
    whole = torch.empty((t.shape[0], seq, *t.shape[2:]), dtype=t.dtype, device=t.device)
    for shard, pos in zip(shards, where, strict=True):
        whole[:, pos] = shard
    return whole


def reshard(t: Tensor, topo: CPTopology, src: str, dst: str) -> Tensor:
    """This rank's shard ``t [b, s_local, ...]`` in sequence layout ``src`` as its shard in
    layout ``dst`` (``zigzag`` or ``contiguous``). Collective over the CP group (an all-gather
    of the whole sequence): for set-up and checks, not for timed calls."""
    n, x = topo.cp_size, topo.cp_rank
    if src == dst or n == 1:
        return t
    seq = t.shape[1] * n

    def positions(r: int, layout: str) -> Tensor:
        return torch.tensor(sequence_positions(r, n, seq, layout), device=t.device)

    whole = _whole(t, topo, [positions(r, src) for r in range(n)])
    return whole[:, positions(x, dst)].contiguous()


def gather_positions(t: Tensor, topo: CPTopology, have: Tensor, want: Tensor) -> Tensor:
    """This rank's shard ``t [b, s_local, ...]``, which holds global positions ``have``, as the
    shard holding ``want``, for layouts that :func:`reshard` does not name (every rank's
    ``have`` is gathered too). Collective: for set-up and checks, not for timed calls."""
    where = [torch.empty_like(have) for _ in range(topo.cp_size)]
    dist.all_gather(where, have.contiguous(), group=topo.cp_group)
    return _whole(t, topo, where)[:, want].contiguous()


def plan_options(cfg: dict) -> PlanOptions:
    """The plan options of a benchmark config (its method is set per contender)."""
    return PlanOptions().replace(**{k: cfg[k] for k in PLAN_KEYS if cfg.get(k) is not None})


def doc_mask(cfg: dict, seq: int) -> DocMask | None:
    """The benchmark's document mask over a ``seq``-token global sequence: ``docs`` (lengths,
    back to back) and/or ``mask_window`` (left tokens; the right side is 0 when causal, the same
    otherwise); ``None`` without either."""
    docs, left = cfg.get("docs"), cfg.get("mask_window")
    if not docs and not left:
        return None
    lens = tuple(docs) if docs else (seq,)
    if sum(lens) != seq:
        raise ValueError(
            f"--docs lengths sum to {sum(lens)} tokens, but the global sequence has {seq} "
            "(nodes x ranks per node x --seq-local); make them equal"
        )
    window = None if not left else (left, 0 if cfg["causal"] else left)
    return DocMask(lens, window=window)


class Ours(Contender):
    def __init__(
        self,
        name: str,
        inp: Inputs,
        causal: bool,
        scale: float,
        topo: CPTopology,
        kernel: str | BlockKernel | None = None,
        options: PlanOptions | None = None,
        mask: DocMask | None = None,
    ) -> None:
        super().__init__(name, inp, causal, scale)
        self.topo, self.kernel, self.mask = topo, kernel, mask
        self.options = (options or PlanOptions()).replace(method=name)
        # set by the benchmark to a list to record the executor's traces of the next call
        self.trace: list | None = None
        # the sequence layout this method expects (non-causal attention works on any)
        self.seq_layout = self.options.seq_layout if causal else "zigzag"
        q, k, v, dout = (
            reshard(t, topo, "zigzag", self.seq_layout) for t in (inp.q, inp.k, inp.v, inp.dout)
        )
        # Megatron's native layout, so cp_attention makes no layout copies.
        self.q, self.k, self.v = (
            t.transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)
        )
        self.dout = dout.transpose(0, 1).contiguous()

    def _call(self) -> Tensor:
        from megatron_charm import cp_attention

        return cp_attention(
            self.q,
            self.k,
            self.v,
            self.topo,
            options=self.options,
            causal=self.causal,
            softmax_scale=self.scale,
            qkv_format="sbhd",
            kernel=self.kernel,
            trace=self.trace,
            mask=self.mask,
        )

    def forward(self) -> Tensor:
        """``out [b, s_local, h, d]``: ``cp_attention`` on ``q [s_local, b, h, d]``, ``k, v
        [s_local, b, h_kv, d]`` (``sbhd``, in ``seq_layout``), transposed back to ``bshd``."""
        return self._call().transpose(0, 1)

    def forward_backward(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(out, dq, dk, dv)`` in ``bshd`` (``[b, s_local, h or h_kv, d]``), in
        ``seq_layout``."""
        for t in (self.q, self.k, self.v):
            t.grad = None
        out = self._call()
        out.backward(self.dout)
        return tuple(t.transpose(0, 1) for t in (out, self.q.grad, self.k.grad, self.v.grad))

    def comparable(self, results: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """``results [b, s_local, ...]`` from ``seq_layout`` to zigzag (collective)."""
        return tuple(reshard(t, self.topo, self.seq_layout, "zigzag") for t in results)


class RingFlash(Contender):
    def __init__(self, name: str, inp: Inputs, causal: bool, scale: float, use_shim: bool) -> None:
        super().__init__(name, inp, causal, scale)
        from megatron_charm.bench.flash_shim import load_zigzag_ring

        zigzag, ring = load_zigzag_ring(use_shim)
        self.fn = zigzag if causal else ring
        self.q, self.k, self.v = (
            t.detach().clone().requires_grad_() for t in (inp.q, inp.k, inp.v)
        )

    def _call(self) -> Tensor:
        return self.fn(self.q, self.k, self.v, softmax_scale=self.scale, causal=self.causal)

    def forward(self) -> Tensor:
        """``out [b, s_local, h, d]`` from ``q [b, s_local, h, d]``, ``k, v [b, s_local, h_kv,
        d]`` (``bshd``, zigzag)."""
        return self._call()

    def forward_backward(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(out, dq, dk, dv)`` in ``bshd`` (``[b, s_local, h or h_kv, d]``), zigzag."""
        return self._autograd(self.q, self.k, self.v, self.inp.dout)


class RingFlashLlama3(Contender):
    """ring-flash-attention's Llama 3 variant on this rank's contiguous shard, as one packed
    sequence ``[s_local, h, d]`` (``b`` must be 1: the variant packs samples back to back and
    splits the packed sequence, not each sample, over the ranks)."""

    def __init__(
        self,
        name: str,
        inp: Inputs,
        causal: bool,
        scale: float,
        topo: CPTopology,
        use_shim: bool,
    ) -> None:
        super().__init__(name, inp, causal, scale)
        from megatron_charm.bench.flash_shim import load_llama3

        if inp.q.shape[0] != 1:
            raise ValueError(
                f"ring-flash-llama3 runs one sequence per call here, but --batch is "
                f"{inp.q.shape[0]}; set --batch 1 or leave it out of --methods"
            )
        prepare, self.fn = load_llama3(use_shim)
        self.topo = topo
        n, x = topo.cp_size, topo.cp_rank
        q, k, v, dout = (
            reshard(t, topo, "zigzag", "contiguous")[0] for t in (inp.q, inp.k, inp.v, inp.dout)
        )
        self.q, self.k, self.v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        self.dout = dout
        seq = q.shape[0] * n
        cu = torch.tensor([0, seq], dtype=torch.int32, device=q.device)
        self.cu_q, self.cu_k, self.max_q, self.max_k, self.k_slice = prepare(cu, causal, x, n)

    def _call(self) -> Tensor:
        return self.fn(
            self.q, self.k, self.v, self.cu_q, self.cu_k, self.max_q, self.max_k,
            heads_k_stride=1, local_k_slice=self.k_slice, softmax_scale=self.scale,
            causal=self.causal, group=self.topo.cp_group,
        )  # fmt: skip

    def forward(self) -> Tensor:
        """``out [1, s_local, h, d]`` from the packed ``q [s_local, h, d]``, ``k, v [s_local,
        h_kv, d]`` (contiguous shard), with the batch dimension put back."""
        return self._call().unsqueeze(0)

    def forward_backward(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(out, dq, dk, dv)`` in ``bshd`` (``[1, s_local, h or h_kv, d]``), contiguous."""
        return tuple(t.unsqueeze(0) for t in self._autograd(self.q, self.k, self.v, self.dout))

    def comparable(self, results: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """``results [1, s_local, ...]`` from contiguous to zigzag (collective)."""
        return tuple(reshard(t, self.topo, "contiguous", "zigzag") for t in results)


class USP(Contender):
    """yunchang's USP on the benchmark's node split: a Ulysses group per node (``ud`` = ranks
    per node), a ring over the nodes (``rd``). yunchang builds its groups over the whole world,
    so the benchmark's world must be the CP group (it is)."""

    def __init__(
        self,
        name: str,
        inp: Inputs,
        causal: bool,
        scale: float,
        topo: CPTopology,
        use_shim: bool,
    ) -> None:
        super().__init__(name, inp, causal, scale)
        from megatron_charm.bench.flash_shim import load_usp

        if inp.q.dtype == torch.float32:
            # its ring backward starts its float32 accumulators as dq_buffer.to(torch.float32),
            # the kernel's own buffer when that is float32 already, which later blocks overwrite
            raise ValueError(
                "usp (yunchang 0.6.4) computes wrong gradients on float32 inputs: its ring "
                "backward's float32 accumulators alias the kernel's output buffers; run it with "
                "--dtype bf16 or fp16, or leave usp out of --methods"
            )
        yc = load_usp(use_shim)
        n, rd = topo.cp_size, topo.layout.num_nodes
        ud = topo.layout.ranks_per_node
        h, h_kv = inp.q.shape[2], inp.k.shape[2]
        if h % ud or h_kv % ud:
            raise ValueError(
                f"usp splits the heads over the ranks of a node: h={h} and h_kv={h_kv} must be "
                f"divisible by ranks_per_node={ud}; change --heads/--kv-heads or leave usp out "
                "of --methods"
            )
        if dist.get_world_size() != n:
            raise ValueError("usp builds its groups over the whole world: run it with one CP group")
        yc.set_seq_parallel_pg(ud, rd, dist.get_rank(), n)
        kind = "zigzag" if causal else "basic"
        self.topo = topo
        self.attn = yc.LongContextAttention(ring_impl_type=kind)
        seq = inp.q.shape[1] * n
        where = torch.arange(seq, device=inp.q.device).view(1, seq, 1)
        self.mine = yc.EXTRACT_FUNC_DICT[kind](where, dist.get_rank(), n, rd, ud).view(-1)
        self.zigzag = inp.idx.to(inp.q.device).view(-1)
        q, k, v, dout = (
            gather_positions(t, topo, self.zigzag, self.mine)
            for t in (inp.q, inp.k, inp.v, inp.dout)
        )
        self.q, self.k, self.v = (t.clone().requires_grad_() for t in (q, k, v))
        self.dout = dout

    def _call(self) -> Tensor:
        return self.attn(self.q, self.k, self.v, softmax_scale=self.scale, causal=self.causal)

    def forward(self) -> Tensor:
        """``out [b, s_local, h, d]`` from ``q [b, s_local, h, d]``, ``k, v [b, s_local, h_kv,
        d]`` (``bshd``, in yunchang's shard layout)."""
        return self._call()

    def forward_backward(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(out, dq, dk, dv)`` in ``bshd`` (``[b, s_local, h or h_kv, d]``), in yunchang's
        shard layout."""
        return self._autograd(self.q, self.k, self.v, self.dout)

    def comparable(self, results: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """``results [b, s_local, ...]`` from yunchang's layout to zigzag (collective)."""
        return tuple(gather_positions(t, self.topo, self.mine, self.zigzag) for t in results)


#: Where TE keeps ``attn_forward_func_with_cp`` (it moved in TE 2.2).
TE_CP_MODULES = (
    "transformer_engine.pytorch.attention.dot_product_attention.context_parallel",
    "transformer_engine.pytorch.attention",
)


def _te_cp_function() -> Callable:
    """TE's ``attn_forward_func_with_cp``; its module moved between TE releases."""
    for mod in TE_CP_MODULES:
        try:
            fn = getattr(importlib.import_module(mod), "attn_forward_func_with_cp", None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    raise RuntimeError(
        "te-p2p needs Transformer Engine with attn_forward_func_with_cp (pip install "
        "transformer_engine[pytorch]); leave te-p2p out of --methods otherwise"
    )


def te_cp_kwargs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    topo: CPTopology,
    stream: torch.cuda.Stream,
    causal: bool,
    scale: float,
) -> dict:
    """Keyword arguments of TE's ``attn_forward_func_with_cp`` for ``bshd`` inputs
    ``q [b, s_local, h, d]``, ``k, v [b, s_local, h_kv, d]`` in the zigzag CP layout."""
    b, s_local = q.shape[:2]
    seq = s_local * topo.cp_size
    cu = torch.arange(0, (b + 1) * seq, seq, dtype=torch.int32, device=q.device)
    return dict(
        is_training=True, q=q, k=k, v=v,
        cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seq, max_seqlen_kv=seq,
        cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
        dropout_p=0.0, cp_group=topo.cp_group, cp_global_ranks=topo.global_ranks,
        cp_stream=stream, cp_comm_type="p2p", softmax_scale=scale, qkv_format="bshd",
        attn_mask_type="causal" if causal else "no_mask",
    )  # fmt: skip


class TransformerEngineP2P(Contender):
    """TE's p2p context parallelism on the same zigzag inputs (CUDA; not run on CPU)."""

    def __init__(
        self, name: str, inp: Inputs, causal: bool, scale: float, topo: CPTopology
    ) -> None:
        super().__init__(name, inp, causal, scale)
        if not inp.q.is_cuda:
            raise ValueError("te-p2p runs on CUDA only; leave it out of --methods on CPU")
        self.fn = _te_cp_function()
        self.topo = topo
        self.stream = torch.cuda.Stream()
        self.q, self.k, self.v = (
            t.detach().clone().requires_grad_() for t in (inp.q, inp.k, inp.v)
        )
        self.params = set(inspect.signature(self.fn).parameters)

    def _call(self) -> Tensor:
        kwargs = te_cp_kwargs(
            self.q, self.k, self.v, self.topo, self.stream, self.causal, self.scale
        )
        unknown = sorted(set(kwargs) - self.params)
        if unknown:
            # Dropping one silently (e.g. attn_mask_type) would benchmark different attention.
            raise RuntimeError(
                f"this Transformer Engine's attn_forward_func_with_cp takes no {unknown}; "
                "use a TE release the contract tests cover (2.1 to 2.20)"
            )
        return self.fn(**kwargs)

    def forward(self) -> Tensor:
        """``out [b, s_local, h, d]`` from ``q [b, s_local, h, d]``, ``k, v [b, s_local, h_kv,
        d]`` (``bshd``, zigzag); TE's output viewed as ``q``'s shape."""
        return self._call().view_as(self.q)

    def forward_backward(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(out, dq, dk, dv)`` in ``bshd`` (``[b, s_local, h or h_kv, d]``), zigzag."""
        for t in (self.q, self.k, self.v):
            t.grad = None
        out = self._call().view_as(self.q)
        out.backward(self.inp.dout)
        return out, self.q.grad, self.k.grad, self.v.grad


def make_contender(
    name: str, inp: Inputs, causal: bool, scale: float, topo: CPTopology, opts: dict
) -> Contender:
    """Build the contender ``name`` (see the module docstring); raises ``ValueError`` if unknown."""
    mask = opts.get("mask")
    if name in OURS:
        kernel, options = opts.get("kernel"), opts.get("options")
        return Ours(name, inp, causal, scale, topo, kernel, options, mask)
    if mask is not None:
        raise ValueError(
            f"benchmark method {name!r} runs without document masks here; drop it from "
            "--methods or drop --docs / --mask-window"
        )
    if name == "ring-flash":
        return RingFlash(name, inp, causal, scale, use_shim=not inp.q.is_cuda)
    if name == "usp":
        return USP(name, inp, causal, scale, topo, use_shim=not inp.q.is_cuda)
    if name == "ring-flash-llama3":
        return RingFlashLlama3(name, inp, causal, scale, topo, use_shim=not inp.q.is_cuda)
    if name == "te-p2p":
        return TransformerEngineP2P(name, inp, causal, scale, topo)
    raise ValueError(
        f"unknown benchmark method {name!r}; expected some of {OURS + BASELINES} (--methods)"
    )


def barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
