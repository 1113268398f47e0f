"""Functions the rank pool runs on every rank (imported by name in the worker processes)."""

from __future__ import annotations

import hashlib
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
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    clear_topology_cache()
    parallel_state.initialize_model_parallel(context_parallel_size=world)
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

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    clear_topology_cache()
    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
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
    messages = []
    for kwargs in (
        {"packed_seq_params": PackedSeqParams(qkv_format="thd")},
        {"attention_bias": torch.zeros(1, 2, 8, 8)},
        {"attn_mask_type": AttnMaskType.padding},
    ):
        try:
            module(q, q, q, None, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("")
    parallel_state.destroy_model_parallel()
    clear_topology_cache()
    return [module.method, *messages]
