"""``CharmDotProductAttention``: megatron-core's ``core_attention`` backed by CHARM+.

It is a drop-in for ``DotProductAttention`` / ``TEDotProductAttention`` inside a GPT layer spec
(see :mod:`megatron_charm.megatron.spec`). Every call runs context-parallel attention over the CP
group with one of the CHARM+ methods (``charm``, ``rm+``, ``merge``, ``ring``); with a CP group of
one rank it is plain local attention, so a config that says ``charm`` also trains on one rank.
"""

from __future__ import annotations

import math
import pickle
import weakref
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_charm import env
from megatron_charm.auto import AUTO
from megatron_charm.kernels import BlockKernel
from megatron_charm.kernels.backends import check_kernel_name
from megatron_charm.megatron.compat import check_megatron_compat
from megatron_charm.megatron.groups import get_charm_topology
from megatron_charm.megatron.masks import documents_from_attention_mask, thd_mask
from megatron_charm.plan import PlanOptions
from megatron_charm.plan.docmask import DocMask
from megatron_charm.plan.options import BASELINES, MEGATRON_METHODS, SEQ_LAYOUT_OF

#: Values of ``cp_comm_type`` served by this module: the methods on Megatron's zigzag layout, and
#: ``auto`` (one of every method of ours, picked per layer shape by the simulator on a profile).
CHARM_METHODS: tuple[str, ...] = (*MEGATRON_METHODS, AUTO)


def resolve_method(cp_comm_type: Any, config_cp_comm_type: Any, default: str | None) -> str:
    """Pick the CHARM+ method from megatron's ``cp_comm_type`` plumbing.

    megatron-core passes ``cp_comm_type`` to core_attention only when CP > 1, so with one CP rank
    the method falls back to the config's value and then to the spec's default.

    Raises:
        ValueError: for per-layer lists and for values that are not CHARM+ methods.
    """
    if isinstance(config_cp_comm_type, (list, tuple)) or isinstance(cp_comm_type, (list, tuple)):
        raise ValueError(
            f"cp_comm_type={config_cp_comm_type!r}: a per-layer list of communication types is "
            "not supported with CHARM+ (megatron-core 0.16.1 also indexes that list off by one). "
            f"Pass a single value, e.g. --cp-comm-type charm (one of {', '.join(CHARM_METHODS)})."
        )
    for candidate in (cp_comm_type, config_cp_comm_type, default, "charm"):
        if candidate is not None:
            method = str(candidate)
            break
    if method in SEQ_LAYOUT_OF:
        raise ValueError(
            f"cp_comm_type={method!r} expects {SEQ_LAYOUT_OF[method]} sequence shards, but "
            "Megatron shards the sequence zigzag (get_batch_on_this_cp_rank); it is a baseline "
            "for cp_attention and the simulator. Use --cp-comm-type ring for the ring on "
            "Megatron's layout."
        )
    if method in BASELINES:
        raise ValueError(
            f"cp_comm_type={method!r} is a baseline for cp_attention, the benchmark and the "
            "simulator (the paper's TASP), not served in Megatron; use one of "
            f"{', '.join(CHARM_METHODS)} with --cp-comm-type."
        )
    if method not in CHARM_METHODS:
        raise ValueError(
            f"cp_comm_type={method!r} is not served by CharmDotProductAttention, which implements "
            f"{', '.join(CHARM_METHODS)}. Use one of those with --cp-comm-type, or build the model "
            "with the stock Transformer Engine spec for p2p/a2a/all_gather."
        )
    return method


def resolve_kernel(kernel: str | BlockKernel | None) -> str | BlockKernel | None:
    """The block kernel of the Megatron module: ``kernel`` when given, else
    ``$MEGATRON_CHARM_KERNEL`` (read once, here, at model construction: Megatron-LM has no
    argument to carry it), else ``None`` (``cp_attention`` picks by device and dtype).

    Raises:
        ValueError: for a name that is not a block kernel, naming where it came from.
    """
    if kernel is None:
        kernel, source = env.kernel(), env.KERNEL
    else:
        source = "kernel"
    check_kernel_name(kernel, source, "leave it unset for the default by device and dtype")
    return kernel


class CharmDotProductAttention(MegatronModule):
    """Context-parallel core attention with the CHARM+ schedules.

    Constructor keywords follow megatron-core's ``CoreAttentionBuilder`` (the same in 0.16.1 and
    0.19.x); ``k_channels`` and ``v_channels`` are accepted for MLA. ``method``,
    ``ranks_per_node``, ``node_split`` and ``options`` (the :class:`megatron_charm.PlanOptions`;
    its method is replaced by the resolved ``cp_comm_type``) and ``timeout_s`` (seconds before a
    blocked exchange fails: Megatron-LM's ``--distributed-timeout-minutes``) and ``profile``
    (what ``cp_comm_type="auto"`` chooses from: Megatron-LM's ``--charm-profile``) and
    ``kernel`` (the block kernel, see :func:`resolve_kernel`) are extra keywords that spec helpers
    set through ``ModuleSpec.params``.

    Checkpoints: like Transformer Engine's attention, the module saves an ``_extra_state`` entry
    and accepts TE's on load, so state dicts move between a TE-spec run and a CHARM+ run in both
    directions. Without FP8 metadata to carry over it saves a ``uint8`` tensor holding a pickled
    ``None``, which every TE 2.x ``set_extra_state`` reads as "no FP8 state" (TE >= 2.4 itself
    saves an empty tensor, which TE 2.1 cannot read back).

    Supported: self-attention, causal (Megatron's zigzag CP layout) and no-mask attention, MHA/GQA/
    MQA through ``num_query_groups``, ``softmax_scale``, fp32/bf16/fp16, packed documents (THD
    ``packed_seq_params``, ``--reset-attention-mask``) and sliding windows (``window_size``),
    whose empty blocks the plan skips. CUDA graphs that would
    capture this module are refused (its communication is scheduled from Python). Everything else
    raises a ``ValueError`` that says what to change.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        method: str | None = None,
        ranks_per_node: int | None = None,
        options: PlanOptions | None = None,
        node_split: str = "host",
        timeout_s: float | None = None,
        profile: str | None = None,
        kernel: str | BlockKernel | None = None,
    ) -> None:
        super().__init__(config=config)
        check_megatron_compat()
        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        self.method = resolve_method(cp_comm_type, getattr(config, "cp_comm_type", None), method)
        if (self.method == AUTO) != (profile is not None):
            raise ValueError(
                f"cp_comm_type={self.method!r} with profile={profile!r}: --cp-comm-type auto needs "
                "--charm-profile (a `megatron-charm-sim calibrate` JSON, or H100/H20/L20), and "
                "the other methods take none"
            )
        self.profile = profile
        self.kernel = resolve_kernel(kernel)
        self.options = options or PlanOptions()
        if self.method != AUTO:
            self.options = self.options.replace(method=self.method)
        _check_config(config, attention_type, attn_mask_type, attention_dropout)

        head_dim_k = k_channels if k_channels is not None else config.kv_channels
        head_dim_v = v_channels if v_channels is not None else config.kv_channels
        if head_dim_k != head_dim_v:
            raise ValueError(
                f"k_channels={head_dim_k} differs from v_channels={head_dim_v}: CHARM+ needs one "
                "head dimension for q, k and v (MLA with distinct value heads is not supported). "
                "Use standard attention, or set the MLA head dims equal."
            )
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.window = _window_of(config)
        # (weak reference to Megatron's mask object, the document masks read from it)
        self._mask_cache: tuple[weakref.ref, list[DocMask | None]] | None = None
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim_k)
        )
        # megatron-core reads this when qk_clip / max-logit logging is on; we refuse those options
        # above, but keep the attribute so the surrounding code finds what it expects.
        self.current_max_attn_logits = None
        self.pg_collection = pg_collection
        # Built here, at model construction, while every rank is present (see groups.py).
        self.topology = get_charm_topology(
            pg_collection,
            ranks_per_node=ranks_per_node,
            node_split=node_split,
            hierarchical_cp_sizes=getattr(config, "hierarchical_context_parallel_sizes", None),
            timeout_s=timeout_s,
        )
        # Transformer Engine's core_attention checkpoints an ``_extra_state`` (its FP8 metadata);
        # we keep what a TE checkpoint brings and hand it back, so --cp-comm-type can switch
        # between TE's p2p and CHARM+ from one checkpoint to the next (see state_dict below).
        self._te_extra_state: Any = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        /,
        *,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any | None = None,
    ) -> torch.Tensor:
        """Attention over the whole (context-parallel) sequence.

        Args:
            query: ``[s_local, b, np, hn]``, or ``[t_local, np, hn]`` with THD
                ``packed_seq_params`` (Transformer Engine's THD order).
            key: ``[s_local, b, ng, hn]`` (``[t_local, ng, hn]``) with ``np % ng == 0``.
            value: like ``key``.
            attention_mask: with a causal mask type, a boolean ``[b, 1, s_local, s]`` causal
                document mask (``--reset-attention-mask``), read as documents (Note [Megatron
                document masks]); a plain causal mask is one document. Ignored without a causal
                mask type.
            attn_mask_type: overrides the constructor's mask type: ``causal`` / ``no_mask``,
                and with packed sequences also their ``padding`` forms (padding is in the
                cumulative lengths).
            attention_bias: must be ``None``.
            packed_seq_params: THD packed sequences (``cu_seqlens_q/kv`` and their padded forms).

        Returns:
            ``[s_local, b, np * hn]`` (``[t_local, np * hn]`` with THD) in the dtype of ``query``.
        """
        from megatron_charm import cp_attention

        if attention_bias is not None:
            raise ValueError(
                "attention_bias was given: CHARM+ does not support an additive attention bias "
                "(e.g. ALiBi). Use learned absolute or rotary position embeddings instead."
            )
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        packed = packed_seq_params is not None
        causal = _is_causal(mask_type, packed)
        if packed and query.dim() == 3:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        if query.dim() != 4 or key.shape != value.shape or query.shape[:2] != key.shape[:2]:
            raise ValueError(
                f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: "
                "expected [s_local, b, heads, head_dim] (THD: [t_local, heads, head_dim]) "
                "self-attention tensors with equal lengths, and key/value of one shape."
            )

        def attend(q, k, v, mask):
            return cp_attention(
                q,
                k,
                v,
                self.topology,
                method=self.method,
                options=self.options,
                causal=causal,
                softmax_scale=self.softmax_scale,
                qkv_format="sbhd",
                mask=mask,
                profile=self.profile,
                kernel=self.kernel,
            )

        masks = self._masks(query, attention_mask, causal, packed_seq_params)
        if len(set(masks)) == 1:
            out = attend(query, key, value, masks[0])
        else:  # documents differ between samples: one call each
            out = torch.cat(
                [
                    attend(*(t[:, i : i + 1] for t in (query, key, value)), m)
                    for i, m in enumerate(masks)
                ],
                dim=1,
            )
        s_local, batch = out.shape[0], out.shape[1]
        if packed:
            return out.reshape(s_local, -1)
        return out.reshape(s_local, batch, -1)

    def _masks(
        self,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        causal: bool,
        packed_seq_params: Any | None,
    ) -> list[DocMask | None]:
        """The document mask of every sample (``None``: plain attention), cached for the
        layers of one step by the identity of Megatron's mask objects."""
        source = packed_seq_params if packed_seq_params is not None else attention_mask
        if source is None or (packed_seq_params is None and not causal):
            whole = query.shape[0] * self.topology.cp_size
            window = DocMask((whole,), window=self.window) if self.window is not None else None
            return [window] * query.shape[1]
        cached = self._mask_cache
        if cached is not None and cached[0]() is source:
            return cached[1]
        if packed_seq_params is not None:
            masks: list[DocMask | None] = [thd_mask(packed_seq_params, self.window)]
        else:
            assert attention_mask is not None
            masks = documents_from_attention_mask(attention_mask, self.topology, self.window)
        try:
            self._mask_cache = (weakref.ref(source), masks)
        except TypeError:  # not weak-referenceable: no cache
            self._mask_cache = None
        return masks

    def get_extra_state(self) -> Any:
        """What a Transformer Engine checkpoint brought, else TE's "no FP8 state" value."""
        if self._te_extra_state is not None:
            return self._te_extra_state
        return _no_fp8_state()

    def set_extra_state(self, state: Any) -> None:
        """Keep TE's ``_extra_state`` (a ``uint8`` tensor of pickled FP8 metadata, or the older
        ``io.BytesIO``) without unpickling it: CHARM+ has no FP8 state, a later TE run wants it
        back. ``None``, an empty tensor and a pickled ``None`` mean "no state"."""
        if state is None or (
            isinstance(state, torch.Tensor)
            and (state.numel() == 0 or _tensor_bytes(state) == _NO_STATE_PICKLE)
        ):
            self._te_extra_state = None
        else:
            self._te_extra_state = state

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # Checkpoints of the local spec (megatron-core's DotProductAttention) have no extra state.
        key = prefix + "_extra_state"
        if key in missing_keys:
            missing_keys.remove(key)

    def extra_repr(self) -> str:
        topo = self.topology
        kernel = getattr(self.kernel, "name", self.kernel) or "by device and dtype"
        return (
            f"options={self.options}, cp_size={topo.cp_size}, nodes={topo.num_nodes}x"
            f"{topo.ranks_per_node}, softmax_scale={self.softmax_scale:.4g}, kernel={kernel}"
        )


#: ``pickle.dumps(None)``: TE's serialized "no FP8 state" (pickle protocol 4+ adds a frame).
_NO_STATE_PICKLE = pickle.dumps(None)


def _no_fp8_state() -> torch.Tensor:
    return torch.frombuffer(bytearray(_NO_STATE_PICKLE), dtype=torch.uint8)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _is_causal(mask_type: AttnMaskType, packed: bool = False) -> bool:
    """Whether ``mask_type`` is causal. With packed sequences the padding forms are accepted
    too: THD padding lives in the cumulative lengths, and for self-attention of equal q and kv
    lengths bottom-right causal is causal."""
    causal = {AttnMaskType.causal}
    plain = {AttnMaskType.no_mask}
    if packed:
        causal |= {
            getattr(AttnMaskType, name)
            for name in ("padding_causal", "causal_bottom_right", "padding_causal_bottom_right")
            if hasattr(AttnMaskType, name)
        }
        plain.add(AttnMaskType.padding)
    if mask_type in causal:
        return True
    if mask_type in plain:
        return False
    raise ValueError(
        f"attn_mask_type={mask_type}: CHARM+ supports AttnMaskType.causal and "
        "AttnMaskType.no_mask, and with packed sequences (packed_seq_params) their padding forms; "
        "arbitrary masks are not supported. Use a causal GPT layer spec."
    )


def _window_of(config: TransformerConfig) -> tuple[int, int] | None:
    """megatron-core's ``window_size`` as ``(left, right)`` (``-1``: unbounded), checked."""
    window = getattr(config, "window_size", None)
    if window is None:
        return None
    try:
        left, right = (int(x) for x in window)
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size={window!r}: expected (left, right) token counts, -1 for unbounded; "
            "fix --window-size"
        ) from None
    if left < -1 or right < -1:
        raise ValueError(
            f"window_size={window!r}: sizes must be >= 0 or -1 (unbounded); fix --window-size"
        )
    if getattr(config, "window_attn_skip_freq", None):
        raise ValueError(
            f"window_attn_skip_freq={config.window_attn_skip_freq}: CHARM+ applies one window to "
            "every layer; unset --window-attn-skip-freq"
        )
    return (left, right)


def _check_config(
    config: TransformerConfig,
    attention_type: str,
    attn_mask_type: AttnMaskType,
    attention_dropout: float | None,
) -> None:
    """Refuse the options that CHARM+ does not implement, saying which setting to change."""
    if attention_type != "self":
        raise ValueError(
            f"attention_type={attention_type!r}: CHARM+ implements self-attention only; keep the "
            "stock core_attention for cross-attention layers."
        )
    # the padding forms are valid with packed sequences, which only the forward sees
    _is_causal(attn_mask_type, packed=True)
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout and dropout > 0:
        raise ValueError(
            f"attention_dropout={dropout}: CHARM+ does not implement attention dropout (Megatron's "
            "default is 0.1). Set --attention-dropout 0 (config key model.attention_dropout: 0.0)."
        )
    _window_of(config)
    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type != "vanilla":
        raise ValueError(
            f"softmax_type={softmax_type!r}: CHARM+ implements the vanilla softmax only. Set "
            "--softmax-type vanilla."
        )
    for fp8 in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        if getattr(config, fp8, False):
            raise ValueError(
                f"{fp8}=True: CHARM+ computes attention in the input dtype (bf16/fp16/fp32), not "
                f"FP8. Unset {fp8} (FP8 linear layers through --fp8-format stay available)."
            )
    _check_cuda_graphs(config)
    if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
        raise ValueError(
            "qk_clip / log_max_attention_logit need per-head max logits, which CHARM+ does not "
            "compute. Turn off --qk-clip and --log-max-attention-logit."
        )


def captures_attention(config: Any) -> str | None:
    """The CUDA-graph setting of ``config`` (a ``TransformerConfig`` or Megatron-LM's ``args``)
    that would capture this module, or ``None``. Reads ``cuda_graph_scope`` (megatron-core 0.16)
    or, when that is unset, ``cuda_graph_modules`` (its 0.19 name)."""
    for legacy in ("enable_cuda_graph", "external_cuda_graph"):
        if getattr(config, legacy, False):
            return f"{legacy}=True"
    impl = str(getattr(config, "cuda_graph_impl", "none") or "none")
    if impl == "none":
        return None
    # megatron-core 0.19 renamed the setting cuda_graph_modules (its __post_init__ moves a
    # cuda_graph_scope there and clears it); an empty list means the whole layer in both.
    raw = getattr(config, "cuda_graph_scope", None) or getattr(config, "cuda_graph_modules", None)
    raw = raw or []
    scopes = [
        getattr(x, "name", str(x)) for x in (raw if isinstance(raw, (list, tuple)) else [raw])
    ]
    # "local" graphs whole layers (or the whole iteration) whatever the scope; Transformer
    # Engine's graphs leave attention out only when the scope lists other parts alone.
    if impl != "transformer_engine" or not scopes or {"attn", "full"} & set(scopes):
        return f"cuda_graph_impl={impl!r} with cuda_graph_scope={scopes or 'the whole layer'}"
    return None


def _check_cuda_graphs(config: TransformerConfig) -> None:
    setting = captures_attention(config)
    if setting is not None:
        raise ValueError(
            f"{setting}: CUDA graphs would capture CHARM+ attention, whose communication is "
            "scheduled from Python per call (and uses all_gather_object), which a graph replay "
            "cannot repeat. Turn CUDA graphs off (--cuda-graph-impl none, no --enable-cuda-graph "
            "/ --external-cuda-graph), or with cuda_graph_impl=transformer_engine capture only "
            "other parts (e.g. --cuda-graph-scope mlp)."
        )
