"""Spec helpers: put :class:`CharmDotProductAttention` into megatron-core GPT specs.

megatron-core picks ``core_attention`` from the layer spec
(``spec.submodules.self_attention.submodules.core_attention``). The stock local and Transformer
Engine modules refuse ``--cp-comm-type charm``, so the spec must point at our module instead. These
helpers do that for a single layer spec, a list of layer specs, or a block spec, and leave every
other submodule (linear layers, norms, MLP) exactly as megatron-core builds it.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_charm.kernels.backends import check_kernel_name
from megatron_charm.megatron.attention import CHARM_METHODS, CharmDotProductAttention
from megatron_charm.megatron.compat import check_megatron_compat
from megatron_charm.nodes import check_node_split
from megatron_charm.plan import PlanOptions


def charm_core_attention_spec(
    method: str | None = None,
    ranks_per_node: int | None = None,
    options: PlanOptions | None = None,
    node_split: str = "host",
    timeout_s: float | None = None,
    profile: str | None = None,
    kernel: str | None = None,
) -> ModuleSpec:
    """A ``core_attention`` ModuleSpec for :class:`CharmDotProductAttention`.

    Args:
        method: CHARM+ method used when megatron does not pass ``cp_comm_type`` (CP size 1, or no
            ``--cp-comm-type``); ``None`` means ``config.cp_comm_type`` or ``"charm"``.
        ranks_per_node: explicit node split override (see ``groups.resolve_node_split``).
        options: plan options of every layer (:class:`megatron_charm.PlanOptions`; the method
            comes from ``cp_comm_type`` / ``method``).
        node_split: what a node is when it is detected: ``"host"`` or ``"numa"`` (Note [NUMA
            split] in :mod:`megatron_charm.nodes`).
        timeout_s: seconds before a blocked exchange on CHARM+'s channel groups fails (Megatron-LM:
            ``--distributed-timeout-minutes`` x 60); ``None``: ``MEGATRON_CHARM_TIMEOUT_S`` or 600.
        profile: with method ``auto``: the profile it chooses from (a ``megatron-charm-sim
            calibrate`` JSON or a preset name; Megatron-LM's ``--charm-profile``).
        kernel: the block kernel of every layer (``"torch"``, ``"flash_attn"``, ``"math"``);
            ``None``: ``MEGATRON_CHARM_KERNEL``, read when the module is built, else by device
            and dtype (the trainer's ``parallel.kernel``).
    """
    if method is not None and method not in CHARM_METHODS:
        raise ValueError(
            f"method={method!r} is not a CHARM+ method; use one of {', '.join(CHARM_METHODS)}."
        )
    check_kernel_name(
        kernel, "kernel", "None for MEGATRON_CHARM_KERNEL / the default by device and dtype."
    )
    params: dict[str, Any] = {}
    if method is not None:
        params["method"] = method
    if ranks_per_node is not None:
        params["ranks_per_node"] = ranks_per_node
    if options is not None:
        params["options"] = options
    if check_node_split(node_split) != "host":
        params["node_split"] = node_split
    if timeout_s is not None:
        params["timeout_s"] = timeout_s
    if profile is not None:
        params["profile"] = profile
    if kernel is not None:
        params["kernel"] = kernel
    return ModuleSpec(module=CharmDotProductAttention, params=params)


def _swap_layer(layer_spec: Any, core_attention: ModuleSpec) -> bool:
    submodules = getattr(layer_spec, "submodules", None)
    attention = getattr(submodules, "self_attention", None)
    attention_subs = getattr(attention, "submodules", None)
    if attention_subs is None or not hasattr(attention_subs, "core_attention"):
        return False
    attention_subs.core_attention = core_attention
    return True


def apply_charm(
    spec: Any,
    method: str | None = None,
    ranks_per_node: int | None = None,
    options: PlanOptions | None = None,
    node_split: str = "host",
    timeout_s: float | None = None,
    profile: str | None = None,
    kernel: str | None = None,
) -> Any:
    """Return a copy of ``spec`` whose self-attention layers use CHARM+ core attention.

    Args:
        spec: a TransformerLayer ``ModuleSpec``, a list of them, a ``TransformerBlockSubmodules``
            (``layer_specs``), or a ``ModuleSpec`` wrapping one (``TransformerBlock``).
        method, ranks_per_node, options, node_split, timeout_s, profile, kernel: see
            :func:`charm_core_attention_spec`.

    Raises:
        ValueError: if no self-attention ``core_attention`` slot is found in ``spec``.
        MegatronCompatibilityError: if megatron-core's core_attention contract differs from ours.
    """
    check_megatron_compat()
    core_attention = charm_core_attention_spec(
        method, ranks_per_node, options, node_split, timeout_s, profile, kernel
    )
    new_spec = copy.deepcopy(spec)
    if isinstance(new_spec, (list, tuple)):
        layers = list(new_spec)
    elif hasattr(new_spec, "layer_specs"):
        layers = list(new_spec.layer_specs)
    elif hasattr(getattr(new_spec, "submodules", None), "layer_specs"):
        layers = list(new_spec.submodules.layer_specs)
    else:
        layers = [new_spec]
    swapped = sum(_swap_layer(layer, core_attention) for layer in layers)
    if swapped == 0:
        raise ValueError(
            "apply_charm found no self_attention.submodules.core_attention in "
            f"{type(spec).__name__}: pass a GPT TransformerLayer spec, a list of them, or a block "
            "spec."
        )
    return new_spec


def get_gpt_layer_charm_spec(
    use_transformer_engine: bool = False,
    method: str | None = None,
    ranks_per_node: int | None = None,
    options: PlanOptions | None = None,
    node_split: str = "host",
    timeout_s: float | None = None,
    profile: str | None = None,
    kernel: str | None = None,
    **kwargs: Any,
) -> ModuleSpec:
    """megatron-core's GPT layer spec (local or Transformer Engine) with CHARM+ core attention.

    Args:
        use_transformer_engine: start from ``get_gpt_layer_with_transformer_engine_spec`` (fused
            TE linears and norms, GPU) instead of ``get_gpt_layer_local_spec`` (runs on CPU).
        method, ranks_per_node, options, node_split, timeout_s, profile, kernel: see
            :func:`charm_core_attention_spec`.
        **kwargs: forwarded to the megatron-core spec function (``qk_layernorm``,
            ``normalization`` for the local spec, ...). ``multi_latent_attention`` is refused.
    """
    if kwargs.get("multi_latent_attention"):
        raise ValueError(
            "multi_latent_attention=True: CHARM+ needs equal q/k/v head dims, which MLA does not "
            "have. Use standard attention with the CHARM+ spec."
        )
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine:
        base = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    else:
        base = gpt_layer_specs.get_gpt_layer_local_spec(**kwargs)
    return apply_charm(
        base, method, ranks_per_node, options, node_split, timeout_s, profile, kernel
    )


def get_gpt_decoder_block_charm_spec(
    config: Any,
    use_transformer_engine: bool = False,
    method: str | None = None,
    ranks_per_node: int | None = None,
    options: PlanOptions | None = None,
    node_split: str = "host",
    timeout_s: float | None = None,
    profile: str | None = None,
    kernel: str | None = None,
    **kwargs: Any,
) -> Any:
    """megatron-core's GPT decoder block spec (MoE layer patterns included) with CHARM+ attention.

    ``kwargs`` go to ``get_gpt_decoder_block_spec`` (``normalization``, ``vp_stage``, ...).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine, **kwargs)
    return apply_charm(
        block, method, ranks_per_node, options, node_split, timeout_s, profile, kernel
    )
