"""Megatron's ways to describe documents, turned into :class:`megatron_charm.DocMask` es.

Note [Megatron document masks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron describes packed documents in two ways, and CHARM+ reads both:

* ``packed_seq_params`` (THD, ``--sft`` and packed datasets): the global cumulative lengths
  ``cu_seqlens_q`` and their padded form, with every rank's tokens in Transformer Engine's THD
  order. They give the mask directly (:func:`thd_mask`).
* ``--reset-attention-mask``: a dense boolean ``attention_mask`` ``[b, 1, s, s]`` (``True``:
  masked) whose query rows ``get_batch_on_this_cp_rank`` cut to the rank's zigzag share. Row ``p``
  of a causal document mask allows exactly the keys ``[start(p), p]``. Each rank reads the starts
  its rows show, the CP group takes their union (one ``all_reduce`` of ``s`` flags per sample),
  and every rank checks that its rows are exactly the causal document mask of those starts, so a
  mask of any other shape is refused rather than dropped (:func:`documents_from_attention_mask`).
  A single document with no window is plain causal attention and runs unmasked.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_charm.comm.topology import CPTopology
from megatron_charm.plan.docmask import DocMask
from megatron_charm.plan.layout import zigzag_positions

Tensor = torch.Tensor


def _lengths(cu: Any, name: str) -> list[int]:
    values = [int(x) for x in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]
    steps = zip(values[:-1], values[1:], strict=True)
    if len(values) < 2 or values[0] != 0 or any(b < a for a, b in steps):
        raise ValueError(
            f"packed_seq_params.{name}={values}: expected cumulative lengths starting at 0 and "
            "never decreasing; check the packed batch"
        )
    return values


def thd_mask(packed_seq_params: Any, window: tuple[int, int] | None) -> DocMask:
    """The ``thd`` mask of Megatron's ``PackedSeqParams`` (self-attention: q and kv lengths must
    match)."""
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(
            f"packed_seq_params.qkv_format={fmt!r}: CHARM+ reads packed sequences in the 'thd' "
            "format only; build PackedSeqParams(qkv_format='thd', ...)"
        )
    cu_q = _lengths(packed_seq_params.cu_seqlens_q, "cu_seqlens_q")
    cu_kv = _lengths(packed_seq_params.cu_seqlens_kv, "cu_seqlens_kv")
    pad_q = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    pad_kv = getattr(packed_seq_params, "cu_seqlens_kv_padded", None)
    padded_q = _lengths(pad_q, "cu_seqlens_q_padded") if pad_q is not None else None
    padded_kv = _lengths(pad_kv, "cu_seqlens_kv_padded") if pad_kv is not None else None
    if cu_q != cu_kv or padded_q != padded_kv:
        raise ValueError(
            "packed_seq_params has different q and kv sequence lengths; CHARM+ implements packed "
            "self-attention only (cu_seqlens_q must equal cu_seqlens_kv, and their padded forms)"
        )
    return DocMask.from_cu_seqlens(cu_q, padded_q, window)


def documents_from_attention_mask(
    attention_mask: Tensor, topo: CPTopology, window: tuple[int, int] | None
) -> list[DocMask | None]:
    """One mask per sample of a causal document ``attention_mask`` (Note [Megatron document
    masks]); ``None`` for a sample that is one document without a window (plain causal).

    Args:
        attention_mask: bool ``[b, 1, s_local, s]`` (``True``: masked), this rank's zigzag rows.

    Raises:
        ValueError: a mask that is not a causal document mask, or of the wrong shape or dtype.
    """
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        raise ValueError(
            f"attention_mask of dtype {attention_mask.dtype} and shape "
            f"{tuple(attention_mask.shape)}: CHARM+ reads Megatron's boolean [b, 1, s_local, s] "
            "mask (True: masked), as --reset-attention-mask builds it"
        )
    b, _, s_local, seq = attention_mask.shape
    if s_local * topo.cp_size != seq:
        raise ValueError(
            f"attention_mask has {s_local} query rows of {seq} keys with cp_size {topo.cp_size}; "
            f"expected s_local x cp_size = s ({s_local * topo.cp_size}); slice the batch with "
            "get_batch_on_this_cp_rank"
        )
    allowed = ~attention_mask[:, 0]
    first = allowed.to(torch.uint8).argmax(dim=-1)  # [b, s_local]: the row's document start
    starts = torch.zeros(b, seq, dtype=torch.int32, device=attention_mask.device)
    starts.scatter_(1, first.long(), 1)
    if topo.cp_size > 1:
        flags = starts if topo.backend == "nccl" else starts.cpu()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=topo.cp_group)
        starts = flags.to(attention_mask.device)
    starts[:, 0] = 1
    positions = torch.tensor(
        zigzag_positions(topo.cp_rank, topo.cp_size, seq), device=attention_mask.device
    )
    out: list[DocMask | None] = []
    for i in range(b):
        cuts = torch.nonzero(starts[i]).flatten()
        doc_of = torch.cumsum(starts[i], 0) - 1  # [s]: document index of every position
        start_of = cuts[doc_of]
        col = torch.arange(seq, device=attention_mask.device)
        p = positions.unsqueeze(1)
        want = (col.unsqueeze(0) >= start_of[positions].unsqueeze(1)) & (col.unsqueeze(0) <= p)
        if not torch.equal(want, allowed[i]):
            raise ValueError(
                f"attention_mask of sample {i} is not a causal document mask (each token sees "
                "the tokens of its own document up to itself), which is the only dense mask "
                "CHARM+ reads; use --reset-attention-mask masks or packed sequences "
                "(packed_seq_params)"
            )
        bounds = [*cuts.tolist(), seq]
        lens = tuple(b2 - a for a, b2 in zip(bounds[:-1], bounds[1:], strict=True))
        out.append(None if len(lens) == 1 and window is None else DocMask(lens, window=window))
    return out


__all__ = ["documents_from_attention_mask", "thd_mask"]
