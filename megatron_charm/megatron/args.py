"""Megatron-LM's command line for CHARM+: our flags, their checks, and what the patch calls.

The Megatron-LM patch (``patches/megatron-lm-core_v0.16.1.patch``) stays small by calling four
functions of this module from Megatron-LM's own code:

=============================== ==============================================================
Megatron-LM                     calls
=============================== ==============================================================
``_add_distributed_args``       :func:`add_megatron_arguments` (the ``--charm-*`` flags)
``validate_args`` (at its end)  :func:`validate_megatron_args` (refuse what we do not do)
``initialize_megatron``         :func:`build_groups_from_args` (after model-parallel init)
``gpt_builders.gpt_builder``    :func:`apply_charm_from_args` (swap in CHARM+ attention)
=============================== ==============================================================

Every Megatron option that touches attention either works with CHARM+ or is refused here, at
argument time, with a ``ValueError`` that names the flag; ``docs/megatron-lm.md`` has the table.
Megatron-LM's parser imports this module on every run, CHARM+ or not, so it imports the CHARM+
attention and spec code only when a function needs them.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from typing import Any

from megatron_charm.auto import AUTO
from megatron_charm.constants import KERNEL_NAMES
from megatron_charm.nodes import NODE_SPLITS
from megatron_charm.plan.options import (
    MEGATRON_METHODS,
    TE_CP_COMM_TYPES,
    PlanOptions,
    add_plan_arguments,
    flag_name,
    plan_values_from_args,
)

#: ``--cp-comm-type`` values served by megatron-charm.
CHARM_CP_COMM_TYPES: tuple[str, ...] = (*MEGATRON_METHODS, AUTO)
#: The only Megatron-LM model builder the patch puts CHARM+ into; ``pretrain_gpt.py`` names it
#: through ``args_defaults={"charm_model_builder": "gpt"}``.
PATCHED_BUILDER = "gpt"

#: The planner's defaults, which the ``--charm-*`` flags start from.
_DEFAULTS = PlanOptions()


def add_megatron_arguments(group: argparse._ArgumentGroup) -> None:
    """Add the ``--charm-*`` flags to Megatron-LM's distributed argument group."""
    group.add_argument(
        "--charm-ranks-per-node",
        type=int,
        default=None,
        help="CP ranks per node for --cp-comm-type charm (default: from "
        "--hierarchical-context-parallel-sizes, else detected; with tensor parallelism "
        "it is GPUs per node / TP).",
    )
    group.add_argument(
        "--charm-node-split",
        choices=NODE_SPLITS,
        default="host",
        help="what a detected node is: the host, or each NUMA domain of GPUs without NVLink.",
    )
    group.add_argument(
        "--charm-profile",
        default=None,
        help="with --cp-comm-type auto: the profile the method is chosen from, a JSON written "
        "by `megatron-charm-sim calibrate` on this cluster or a preset (H100, H20, L20).",
    )
    group.add_argument(
        "--charm-kernel",
        choices=KERNEL_NAMES,
        default=None,
        help="block attention kernel of the megatron-charm methods (default: "
        "$MEGATRON_CHARM_KERNEL, else flash_attn for bf16/fp16 on GPU when it imports, else "
        "torch; math is the float64 reference).",
    )
    add_plan_arguments(group, prefix="charm-")


def uses_charm(args: argparse.Namespace) -> bool:
    """Whether ``--cp-comm-type`` names a megatron-charm method."""
    return any(value in CHARM_CP_COMM_TYPES for value in _comm_types(args))


def _comm_types(args: argparse.Namespace) -> list[str]:
    value = getattr(args, "cp_comm_type", None) or ["p2p"]
    return [value] if isinstance(value, str) else list(value)


def plan_options_from_args(args: argparse.Namespace) -> PlanOptions:
    """The :class:`PlanOptions` the ``--charm-*`` flags ask for.

    Raises:
        ValueError: naming the flag whose value the planner refuses.
    """
    values = plan_values_from_args(args, prefix="charm-")
    flags = {key: flag_name(key, "charm-") for key in values}
    method = _comm_types(args)[0] if uses_charm(args) else _DEFAULTS.method
    if method == AUTO:
        method = _DEFAULTS.method  # the module picks per layer shape (megatron_charm.auto)
    try:
        return PlanOptions(method=method, **values)  # type: ignore[arg-type]
    except ValueError as exc:
        bad = next((flag for key, flag in flags.items() if f"{key}=" in str(exc)), "--charm-*")
        raise ValueError(f"{bad}: {exc}") from None


def timeout_s_from_args(args: argparse.Namespace) -> float:
    """Seconds before a blocked CHARM+ exchange fails: ``--distributed-timeout-minutes``."""
    minutes = getattr(args, "distributed_timeout_minutes", None)
    if minutes is None or minutes <= 0:
        raise ValueError(
            f"--distributed-timeout-minutes {minutes}: CHARM+'s channel groups use this timeout; "
            "pass a positive number of minutes."
        )
    return float(minutes) * 60.0


def validate_megatron_args(args: argparse.Namespace) -> None:
    """Refuse, at argument time, every option that CHARM+ would fail on or silently ignore.

    Runs at the end of Megatron-LM's ``validate_args`` (when the arguments are final) on every
    run; stock ``--cp-comm-type`` values only get the checks of the ``--charm-*`` flags.

    Raises:
        ValueError: naming the flag, the rule and the flag to change.
    """
    comm_types = _comm_types(args)
    known = TE_CP_COMM_TYPES + CHARM_CP_COMM_TYPES
    for value in comm_types:
        if value not in known:
            raise ValueError(f"--cp-comm-type {value!r} is unknown; use one of: {', '.join(known)}")
    if not uses_charm(args):
        _refuse_charm_flags_without_charm(args)
        return
    method = comm_types[0]
    if len(comm_types) > 1:
        raise ValueError(
            f"--cp-comm-type {' '.join(comm_types)}: per-layer lists are not supported with "
            f"{', '.join(CHARM_CP_COMM_TYPES)}; pass a single value, e.g. --cp-comm-type charm"
        )
    for check in _CHECKS:
        problem = check(args)
        if problem:
            raise ValueError(f"--cp-comm-type {method}: {problem}")
    options = plan_options_from_args(args)
    _check_split_flags(args, options)
    timeout_s_from_args(args)
    profile = getattr(args, "charm_profile", None)
    if (method == AUTO) != (profile is not None):
        raise ValueError(
            f"--cp-comm-type {method} with --charm-profile {profile}: auto chooses the method "
            "from a profile, so it needs --charm-profile (write one with `megatron-charm-sim "
            "calibrate`, or pass H100/H20/L20); the other methods take none"
        )
    if profile is not None:
        from megatron_charm.sim.profile import load_profile

        load_profile(profile)  # refuse a missing or malformed profile before the model is built


def _refuse_charm_flags_without_charm(args: argparse.Namespace) -> None:
    given = [
        flag
        for flag, default in (
            ("--charm-ranks-per-node", None),
            ("--charm-node-split", "host"),
            ("--charm-profile", None),
            ("--charm-kernel", None),
            ("--charm-window", _DEFAULTS.window),
            ("--charm-cross-return", _DEFAULTS.cross_return),
            ("--charm-cross-level", _DEFAULTS.cross_level),
            ("--charm-intra-level", _DEFAULTS.intra_level),
            ("--charm-foreign-q", _DEFAULTS.foreign_q),
            ("--charm-memory-budget", _DEFAULTS.memory_budget),
            ("--charm-combine-nodes", False),
        )
        if getattr(args, flag[2:].replace("-", "_"), default) != default
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)} only apply to --cp-comm-type "
            f"{' | '.join(CHARM_CP_COMM_TYPES)}; add one or drop the option(s)"
        )


def _check_split_flags(args: argparse.Namespace, options: PlanOptions) -> None:
    cp = args.context_parallel_size
    n = getattr(args, "charm_ranks_per_node", None)
    if n is not None and (n < 1 or cp % n != 0):
        raise ValueError(
            f"--charm-ranks-per-node {n} must be a positive divisor of --context-parallel-size {cp}"
        )
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    if sizes and len(sizes) != 2 and n is None:
        raise ValueError(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: CHARM+ reads "
            "two levels, [CP ranks per node, nodes]; pass two sizes, or set the node split with "
            "--charm-ranks-per-node instead"
        )
    rpn = n if n is not None else (sizes[0] if sizes and len(sizes) == 2 else None)
    if options.combine_nodes:
        if options.method != "charm":
            raise ValueError(
                f"--charm-combine-nodes is a charm option; --cp-comm-type is {options.method}"
            )
        if rpn is not None and cp // rpn < 2:
            raise ValueError(
                f"--charm-combine-nodes needs at least two nodes, but --context-parallel-size "
                f"{cp} with {rpn} CP ranks per node makes {cp // rpn}; drop the flag"
            )


# Each check returns what is wrong (the message after "--cp-comm-type charm: ") or None.


def _check_attention_dropout(args: argparse.Namespace) -> str | None:
    p = getattr(args, "attention_dropout", 0.0) or 0.0
    if p > 0:
        return (
            f"--attention-dropout {p} is not implemented by CHARM+ (Megatron-LM's default is "
            "0.1); pass --attention-dropout 0"
        )
    return None


def _check_masks(args: argparse.Namespace) -> str | None:
    # Documents reach CHARM+ as THD packed_seq_params (--sft) or as the dense causal document
    # mask of --reset-attention-mask (Note [Megatron document masks]); without the mask in the
    # batch the documents would be dropped.
    if getattr(args, "reset_attention_mask", False) and not getattr(
        args, "create_attention_mask_in_dataloader", True
    ):
        return (
            "--reset-attention-mask with --no-create-attention-mask-in-dataloader: CHARM+ reads "
            "the documents from the attention mask, which the data loader then does not build; "
            "drop --no-create-attention-mask-in-dataloader"
        )
    for attr, flag, why in (
        ("hybrid_context_parallel", "--hybrid-context-parallel", "a CP size per sample"),
        ("rl_use_sequence_packing", "--rl-use-sequence-packing", "RL sequence packing"),
    ):
        if getattr(args, attr, False):
            return (
                f"{flag} needs {why}, which CHARM+ does not implement (its CP group is fixed per "
                f"model); remove {flag}"
            )
    if getattr(args, "window_attn_skip_freq", None):
        return (
            f"--window-attn-skip-freq {args.window_attn_skip_freq}: CHARM+ applies one window to "
            "every layer; remove it"
        )
    return None


def _check_attention_variants(args: argparse.Namespace) -> str | None:
    if getattr(args, "use_legacy_models", False):
        return "needs megatron-core models; remove --use-legacy-models"
    variant = getattr(args, "experimental_attention_variant", None)
    if variant is not None:
        return f"--experimental-attention-variant {variant} is not supported; remove one of them"
    if getattr(args, "multi_latent_attention", False):
        return (
            "--multi-latent-attention is not supported (MLA's value heads differ from its "
            "query/key heads); remove --multi-latent-attention"
        )
    softmax = getattr(args, "softmax_type", "vanilla")
    if softmax != "vanilla":
        return f"--softmax-type {softmax} is not supported; pass --softmax-type vanilla"
    for attr in ("qk_clip", "log_max_attention_logit"):
        if getattr(args, attr, False):
            flag = "--" + attr.replace("_", "-")
            return f"{flag} needs per-head max logits, which CHARM+ does not compute; remove it"
    return None


def _check_fp8_attention(args: argparse.Namespace) -> str | None:
    # core_v0.16.1 has no command-line flag for these (they come from YAML configs).
    for attr in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        if getattr(args, attr, False):
            return (
                f"{attr} (FP8 attention) is not supported: CHARM+ computes attention in bf16/"
                f"fp16/fp32; unset {attr} (FP8 linear layers via --fp8-format still work)"
            )
    return None


def _check_cuda_graphs(args: argparse.Namespace) -> str | None:
    from megatron_charm.megatron.attention import captures_attention

    setting = captures_attention(args)
    if setting is None:
        return None
    return (
        f"{setting}: CUDA graphs would capture CHARM+ attention, whose communication is "
        "scheduled from Python on every call; pass --cuda-graph-impl none, or with "
        "--cuda-graph-impl transformer_engine capture other parts only (--cuda-graph-scope mlp)"
    )


def _check_builder(args: argparse.Namespace) -> str | None:
    if getattr(args, "modelopt_enabled", False):
        return (
            "ModelOpt's model builder (modelopt_gpt_mamba_builder) keeps its own attention; "
            "turn ModelOpt off or use --cp-comm-type p2p"
        )
    builder = getattr(args, "charm_model_builder", None)
    if builder != PATCHED_BUILDER:
        return (
            "the patch puts CHARM+ into pretrain_gpt.py's GPT builder only; this script builds "
            "another model (Mamba, T5, BERT, VLM, RL ...), whose attention would refuse it. Run "
            "pretrain_gpt.py, or use --cp-comm-type p2p here"
        )
    return None


def _check_local_impl(args: argparse.Namespace) -> str | None:
    if getattr(args, "transformer_impl", None) != "local":
        return None
    if not getattr(args, "gradient_accumulation_fusion", False):
        return None
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None:
        return None
    return (
        "--transformer-impl local fuses gradient accumulation with apex's "
        "fused_weight_gradient_mlp_cuda, which is not installed; pass "
        "--no-gradient-accumulation-fusion (or install apex)"
    )


_CHECKS = (
    _check_builder,
    _check_attention_dropout,
    _check_masks,
    _check_attention_variants,
    _check_fp8_attention,
    _check_cuda_graphs,
    _check_local_impl,
)


def build_groups_from_args(args: argparse.Namespace) -> Any:
    """Build CHARM+'s channel groups on every rank (after ``initialize_model_parallel``).

    Returns the topology, or ``None`` when ``--cp-comm-type`` is not a megatron-charm method.
    See :func:`megatron_charm.megatron.groups.build_charm_groups`.
    """
    if not uses_charm(args):
        return None
    from megatron_charm.megatron.groups import build_charm_groups

    return build_charm_groups(
        ranks_per_node=args.charm_ranks_per_node,
        hierarchical_cp_sizes=args.hierarchical_context_parallel_sizes,
        node_split=args.charm_node_split,
        timeout_s=timeout_s_from_args(args),
    )


def apply_charm_from_args(spec: Any, args: argparse.Namespace) -> Any:
    """``spec`` with CHARM+ core attention when ``--cp-comm-type`` selects it, else ``spec``.

    Args:
        spec: the layer or block spec Megatron-LM chose (see :func:`apply_charm`).
        args: Megatron-LM's validated arguments.
    """
    if not uses_charm(args):
        return spec
    from megatron_charm.megatron.spec import apply_charm

    return apply_charm(
        spec,
        ranks_per_node=args.charm_ranks_per_node,
        options=plan_options_from_args(args),
        node_split=args.charm_node_split,
        timeout_s=timeout_s_from_args(args),
        profile=getattr(args, "charm_profile", None),
        kernel=getattr(args, "charm_kernel", None),
    )


def megatron_defaults(names: Sequence[str] | None = None) -> dict[str, Any]:
    """Megatron-LM ``core_v0.16.1``'s defaults of the arguments these checks read, plus ours.

    For tests and tools that build an ``argparse.Namespace`` without Megatron-LM's parser (the
    parser lives in ``megatron/training``, which the megatron-core wheel does not ship).
    """
    defaults: dict[str, Any] = {
        "cp_comm_type": ["p2p"],
        "context_parallel_size": 1,
        "hierarchical_context_parallel_sizes": None,
        "distributed_timeout_minutes": 10,
        "attention_dropout": 0.1,
        "reset_attention_mask": False,
        "create_attention_mask_in_dataloader": True,
        "window_attn_skip_freq": None,
        "sft": False,
        "hybrid_context_parallel": False,
        "rl_use_sequence_packing": False,
        "use_legacy_models": False,
        "experimental_attention_variant": None,
        "multi_latent_attention": False,
        "window_size": None,
        "softmax_type": "vanilla",
        "qk_clip": False,
        "log_max_attention_logit": False,
        "cuda_graph_impl": "none",
        "cuda_graph_scope": [],
        "transformer_impl": "transformer_engine",
        "gradient_accumulation_fusion": True,
        "deterministic_mode": False,
        "charm_ranks_per_node": None,
        "charm_node_split": "host",
        "charm_profile": None,
        "charm_kernel": None,
        "charm_window": _DEFAULTS.window,
        "charm_cross_return": _DEFAULTS.cross_return,
        "charm_cross_level": _DEFAULTS.cross_level,
        "charm_intra_level": _DEFAULTS.intra_level,
        "charm_foreign_q": _DEFAULTS.foreign_q,
        "charm_memory_budget": _DEFAULTS.memory_budget,
        "charm_combine_nodes": False,
    }
    return defaults if names is None else {k: defaults[k] for k in names}
