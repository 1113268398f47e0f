"""Functions the rank pool runs on every rank (imported by name in the worker processes)."""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from typing import Any

import torch
import torch.distributed as dist

#: A small, fast variant of the tiny default: 10 steps on the shipped corpus, no checkpoints.
BASE_OVERRIDES = [
    "train.train_iters=10",
    "train.lr_warmup_iters=2",
    "model.seq_length=64",
    "logging.log_interval=1000",
    "logging.progress_interval_s=0",
    "checkpoint.save=false",
    # workloads with the same overrides share a run directory; each starts it over
    "run.overwrite=true",
    "parallel.timeout_s=120",
    # each test states its node split; the default config emulates 2 nodes of 2 ranks
    "parallel.ranks_per_node=null",
]


def train_run(overrides: list[str], capture_grads_at: int | None = 0) -> dict[str, Any]:
    """Train with the embedded default + ``BASE_OVERRIDES`` + ``overrides``.

    Returns the per-iteration losses and, on global rank 0, the reduced gradients of iteration
    ``capture_grads_at`` (taken before the optimizer step).
    """
    from megatron_charm.train import load_config, train

    overrides = list(overrides)
    if not any(o.startswith("run.dir=") for o in overrides):
        # Same directory on every rank, distinct per workload, outside the source tree.
        key = hashlib.sha1(repr(overrides).encode()).hexdigest()[:12]
        overrides.append(f"run.dir={os.path.join(os.environ['MC_TEST_RUN_ROOT'], key)!r}")
    cfg = load_config(None, BASE_OVERRIDES + overrides)
    grads: dict[str, torch.Tensor] = {}

    def hook(iteration: int, model: torch.nn.Module) -> None:
        if iteration == capture_grads_at:
            for name, param in model.named_parameters():
                grads[name] = param.grad.detach().clone()

    result = train(cfg, grad_hook=hook)
    from megatron.core import parallel_state

    from megatron_charm.megatron import cached_topologies

    nodes = [(t.num_nodes, t.ranks_per_node) for t in cached_topologies()]
    parallel_state.destroy_model_parallel()
    return {
        "losses": result.losses,
        "start": result.start_iteration,
        "grads": grads if dist.get_rank() == 0 else None,
        "nodes": nodes,
    }


def train_error(overrides: list[str]) -> str | None:
    """Like :func:`train_run`, but returns this rank's error message (``None`` if it trained)."""
    from megatron.core import parallel_state

    try:
        train_run(overrides, capture_grads_at=None)
    except ValueError as exc:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        return str(exc)
    return None


def train_open_files(overrides: list[str]) -> int:
    """Train as :func:`train_run` does; return this process's open files after it."""
    train_run(overrides, capture_grads_at=None)
    return len(os.listdir("/proc/self/fd"))


def fresh_cp_state(cp_size: int) -> None:
    """Megatron's parallel state with one CP group of ``cp_size``, and no cached topologies."""
    from megatron.core import parallel_state

    from megatron_charm.megatron import clear_topology_cache

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    clear_topology_cache()
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)


def _reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    """fp64 attention on full sequences; q ``[s, b, h, d]``, k/v ``[s, b, hk, d]``."""
    h, hk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q.double(), k.double()) * scale
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", torch.softmax(scores, -1), v.double())


def module_vs_reference(
    method: str,
    causal: bool,
    heads: int,
    groups: int,
    ranks_per_node: int | None,
    softmax_scale: float | None = None,
) -> float:
    """Run ``CharmDotProductAttention`` on this rank's zigzag share and compare with fp64.

    Returns the largest absolute error of this rank's output and of the gradients of q, k and v
    (each relative to the reference's magnitude).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_charm.megatron import CharmDotProductAttention, clear_topology_cache

    world = dist.get_world_size()
    fresh_cp_state(world)
    head_dim, batch, seq = 8, 2, 16 * world
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        context_parallel_size=world,
        cp_comm_type=method,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
    module = CharmDotProductAttention(
        config=config,
        layer_number=1,
        attn_mask_type=mask,
        attention_type="self",
        cp_comm_type=method,
        softmax_scale=softmax_scale,
        pg_collection=None,
        ranks_per_node=ranks_per_node,
    )
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(seq, batch, heads, head_dim, generator=gen)
    k = torch.randn(seq, batch, groups, head_dim, generator=gen)
    v = torch.randn(seq, batch, groups, head_dim, generator=gen)
    rank = dist.get_rank()
    if causal:
        chunk = seq // (2 * world)
        idx = list(range(rank * chunk, (rank + 1) * chunk))
        idx += list(range((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk))
    else:
        per = seq // world
        idx = list(range(rank * per, (rank + 1) * per))
    index = torch.tensor(idx)
    q_full, k_full, v_full = (t.clone().requires_grad_(True) for t in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    ref = _reference_attention(q_full, k_full, v_full, causal, scale)
    ref.sum().backward()
    q_local, k_local, v_local = (t[index].clone().requires_grad_(True) for t in (q, k, v))
    out = module(q_local, k_local, v_local, None, attn_mask_type=mask)
    assert out.shape == (len(idx), batch, heads * head_dim), out.shape
    out.sum().backward()
    expected = ref.detach()[index].reshape(len(idx), batch, -1).float()
    errors = [(out.detach() - expected).abs().max() / expected.abs().max()]
    for local, full in ((q_local, q_full), (k_local, k_full), (v_local, v_full)):
        want = full.grad[index]
        errors.append((local.grad - want).abs().max() / want.abs().max())
    parallel_state.destroy_model_parallel()
    clear_topology_cache()
    return float(max(errors))


def forward_errors() -> list[str]:
    """Messages of the ValueErrors the module raises for unsupported forward arguments."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_charm.megatron import CharmDotProductAttention, clear_topology_cache

    fresh_cp_state(dist.get_world_size())
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0
    )
    module = CharmDotProductAttention(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type=None,
        softmax_scale=None,
        pg_collection=None,
    )
    q = torch.randn(8, 1, 2, 8)
    arbitrary = torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(0)) > 0.5
    messages = []
    for mask, kwargs in (
        (None, {"packed_seq_params": PackedSeqParams(qkv_format="sbhd")}),
        (None, {"attention_bias": torch.zeros(1, 2, 8, 8)}),
        (None, {"attn_mask_type": AttnMaskType.padding}),
        (arbitrary, {}),
    ):
        try:
            module(q, q, q, mask, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("")
    parallel_state.destroy_model_parallel()
    clear_topology_cache()
    return [module.method, *messages]


def module_documents_vs_reference(kind: str, window: tuple[int, int] | None = None) -> float:
    """``CharmDotProductAttention`` with documents against fp64 on the gathered sequence.

    ``kind``: ``thd`` (``packed_seq_params`` with padded sequences, tokens in Transformer
    Engine's THD order, ``[t, heads, d]`` tensors) or ``reset`` (Megatron's dense causal document
    ``attention_mask``, different documents in each of two samples, zigzag rows). ``window``:
    megatron-core's ``window_size``. Returns the largest error of out, dq, dk, dv relative to the
    reference's magnitude.
    """
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_charm as mc
    from megatron_charm.megatron import CharmDotProductAttention, clear_topology_cache
    from tests.gloo.mask_tasks import allowed_matrix, token_table
    from tests.gloo.reference import naive_attention

    world = dist.get_world_size()
    fresh_cp_state(world)
    heads, groups, head_dim = 4, 2, 8
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        context_parallel_size=world,
        cp_comm_type="charm",
        attention_dropout=0.0,
        use_cpu_initialization=True,
        window_size=window,
    )
    module = CharmDotProductAttention(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.padding_causal if kind == "thd" else AttnMaskType.causal,
        attention_type="self",
        cp_comm_type="charm",
        pg_collection=None,
        ranks_per_node=2 if world % 2 == 0 else None,
    )
    rank, unit = dist.get_rank(), 2 * world
    if kind == "thd":
        masks = [mc.DocMask((3 * unit, unit, 4 * unit), "thd", (3 * unit - 5, unit, 4 * unit - 1))]
    else:
        masks = [mc.DocMask((5, 20, 3, 36)), mc.DocMask((32, 32))]
    plain, masks = masks, [mc.DocMask(m.seq_lens, m.layout, m.real_lens, window) for m in masks]
    seq = masks[0].total
    gen = torch.Generator().manual_seed(11)
    batch = len(masks)
    q, k, v = (torch.randn(seq, batch, n, head_dim, generator=gen) for n in (heads, groups, groups))
    dout = torch.randn(seq, batch, heads, head_dim, generator=gen)
    tables = [token_table(m, world) for m in masks]
    scale = 1.0 / math.sqrt(head_dim)
    refs, grads = [], []
    for i, m in enumerate(masks):
        allowed = allowed_matrix(m, tables[i][0], True)
        full = [t[:, i : i + 1].transpose(0, 1).double().requires_grad_(True) for t in (q, k, v)]
        out, _ = naive_attention(*full, False, scale, True, allowed)
        (out * dout[:, i : i + 1].transpose(0, 1).double()).sum().backward()
        refs.append(out.detach().transpose(0, 1))
        grads.append([t.grad.transpose(0, 1) for t in full])
    index = torch.tensor(tables[0][1][rank])
    local = [t[index].clone().requires_grad_(True) for t in (q, k, v)]
    if kind == "thd":
        cu = torch.tensor([0, *itertools.accumulate(masks[0].real_lens)], dtype=torch.int32)
        cu_pad = torch.tensor([0, *itertools.accumulate(masks[0].seq_lens)], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_pad,
            cu_seqlens_kv_padded=cu_pad,
        )
        out = module(*(t[:, 0] for t in local), None, packed_seq_params=params)
        assert out.shape == (len(index), heads * head_dim), out.shape
        out = out.reshape(len(index), 1, heads, head_dim)
    else:
        rows = []
        for i, (table, _) in enumerate(tables):
            rows.append(~allowed_matrix(plain[i], table, True)[index])  # documents only
        attention_mask = torch.stack(rows).unsqueeze(1)  # [b, 1, s_local, s], True: masked
        out = module(*local, attention_mask).reshape(len(index), batch, heads, head_dim)
    (out.double() * dout[index].double()).sum().backward()
    want = torch.cat(refs, dim=1)[index]
    errors = [float((out.detach().double() - want).abs().max() / want.abs().max())]
    for j, t in enumerate(local):
        ref = torch.cat([g[j] for g in grads], dim=1)[index]
        errors.append(float((t.grad.double() - ref).abs().max() / ref.abs().max()))
    parallel_state.destroy_model_parallel()
    clear_topology_cache()
    return max(errors)
