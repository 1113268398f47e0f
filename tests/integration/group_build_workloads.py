"""Rank-pool tasks for the group-building tests (imported by name in the worker processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

#: Short enough that a regression (a hang) fails within the test's own deadline.
TIMEOUT_S = 30.0


def _fresh_parallel_state(**sizes: int) -> None:
    from megatron.core import parallel_state

    from megatron_charm.megatron import clear_topology_cache

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    clear_topology_cache()
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False, **sizes)


def stage_without_attention() -> dict[str, Any]:
    """CP 2 x PP 2: groups built on every rank, attention built only on pipeline stage 0.

    Stage 1 stands for an embedding-only or loss-only stage: it builds no attention layer, so it
    never reaches a CharmDotProductAttention constructor.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_charm.megatron import (
        CharmDotProductAttention,
        build_charm_groups,
        cached_topologies,
        clear_topology_cache,
    )

    _fresh_parallel_state(context_parallel_size=2, pipeline_model_parallel_size=2)
    built = build_charm_groups(timeout_s=TIMEOUT_S)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    result: dict[str, Any] = {"stage": stage, "reused": None, "shape": None}
    if stage == 0:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            attention_dropout=0.0,
            context_parallel_size=2,
            cp_comm_type="charm",
        )
        module = CharmDotProductAttention(
            config, 1, AttnMaskType.causal, "self", cp_comm_type="charm", timeout_s=TIMEOUT_S
        )
        q = torch.randn(8, 1, 2, 8)
        out = module(q, q.clone(), q.clone(), None)
        result["reused"] = module.topology is built and len(cached_topologies()) == 1
        result["shape"] = tuple(out.shape)
    # Both stages meet again here: stage 1 did not wait in a group creation.
    dist.barrier()
    parallel_state.destroy_model_parallel()
    clear_topology_cache()
    return result


def disagreeing_split(kind: str) -> str | None:
    """Every rank builds CHARM+'s groups; rank 0 (or 1) sees another split. Returns the error."""
    from megatron.core import parallel_state

    from megatron_charm.megatron import build_charm_groups, clear_topology_cache

    _fresh_parallel_state(context_parallel_size=dist.get_world_size())
    rank = dist.get_rank()
    kwargs: dict[str, Any] = {"ranks_per_node": 2}
    if kind == "ranks_per_node" and rank == 0:
        kwargs = {"ranks_per_node": 4}
    elif kind == "detected" and rank == 0:
        kwargs = {"ranks_per_node": None}
    elif kind == "invalid" and rank == 1:
        kwargs = {"ranks_per_node": 3}
    try:
        build_charm_groups(timeout_s=TIMEOUT_S, **kwargs)
        error = None
    except ValueError as exc:
        error = str(exc)
    parallel_state.destroy_model_parallel()
    clear_topology_cache()
    return error


def cleared_topologies(rounds: int) -> list[tuple[int, bool, str | None]]:
    """Set up CP 4 (2 nodes x 2) ``rounds`` times, each with an attention call and a teardown by
    ``destroy_model_parallel`` and ``clear_topology_cache``.

    Per round: how many of the topology's own groups (channels, control) this rank still holds
    after the teardown, whether the cache is empty, and the error of a call on the cleared
    topology."""
    from megatron.core import parallel_state

    import megatron_charm as mc
    from megatron_charm.comm.topology import live_process_groups
    from megatron_charm.megatron import build_charm_groups, cached_topologies, clear_topology_cache

    q = torch.randn(1, 8, 2, 8)  # [b, s, h, d]
    out = []
    for _ in range(rounds):
        _fresh_parallel_state(context_parallel_size=dist.get_world_size())
        topo = build_charm_groups(ranks_per_node=2, timeout_s=TIMEOUT_S)
        mc.cp_attention(q, q, q, topo, method="charm")
        own = {*topo.channels.values(), topo.control}
        parallel_state.destroy_model_parallel()
        clear_topology_cache()
        try:
            mc.cp_attention(q, q, q, topo, method="charm")
            error = None
        except ValueError as exc:
            error = str(exc)
        out.append((len(own & live_process_groups()), not cached_topologies(), error))
    return out
