"""The attention layer and CP group of a Megatron-LM launch line, for ``megatron-charm-sim``.

``megatron-charm-sim advise --preset H100 --gpus-per-node 8 --megatron "--num-attention-heads
32 --group-query-attention --num-query-groups 8 --hidden-size 4096 --seq-length 131072
--micro-batch-size 1 --tensor-model-parallel-size 2 --context-parallel-size 16 --bf16"`` reads
the flags that shape one attention layer and its CP group, as Megatron-LM (``core_v0.16.1``'s
``arguments.py``) reads them, and ignores the others:

* heads: ``--num-attention-heads``; kv heads: ``--num-query-groups`` with
  ``--group-query-attention`` (Megatron's default 1), else every head (a ``--num-query-groups``
  without it is named in the line that says what was read: Megatron reads it only then); head dim:
  ``--kv-channels``, else ``--hidden-size / --num-attention-heads``;
* tokens: ``--seq-length``, ``--micro-batch-size`` (1 if absent); GPT attention is causal;
* bytes per element: 2 with ``--bf16`` or ``--fp16``, else 4;
* per TP rank (:func:`megatron_charm.sim.node_groups.per_rank_heads`): heads / TP, and kv
  heads / TP, or one where the query groups divide TP (Megatron core 0.16's attention);
* the CP group: Megatron places ranks tensor-parallel first, then context-parallel
  (``tp-cp-ep-dp-pp``), so a node of ``G`` GPUs holds ``p = min(CP, G / TP)`` ranks of a CP group,
  which spans ``m = CP / p`` nodes, and ``G / p`` CP groups share the node (the TP ranks' and the
  replicas': Note [Groups sharing a node] in :mod:`megatron_charm.sim.node_groups`).

:func:`apply_problem_source` fills the CLI's problem flags from it, or their defaults without
``--megatron``.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

from megatron_charm.plan import METHODS


@dataclass(frozen=True)
class MegatronLayer:
    """One attention layer and its CP group, as a Megatron-LM launch line sets them."""

    batch: int
    seq: int
    heads: int
    """Query heads of the model (all TP ranks)."""
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    tp: int
    nodes: int
    """``m``: nodes the CP group spans."""
    ranks_per_node: int
    """``p``: ranks of the CP group on each node."""
    groups_per_node: int
    """CP groups with ranks on each node (GPUs per node / ``p``)."""
    cp_comm_types: tuple[str, ...] = ("p2p",)
    """The run's ``--cp-comm-type`` (one per layer where it lists several; Megatron's default
    ``p2p``)."""
    unread: tuple[str, ...] = ()
    """Flags of the line that Megatron does not read as given, each with why (so the line that
    says what was read can say it too)."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="--megatron", add_help=False)
    ap.add_argument("--num-attention-heads", type=int)
    ap.add_argument("--group-query-attention", action="store_true")
    ap.add_argument("--num-query-groups", type=int, default=None)
    ap.add_argument("--kv-channels", type=int)
    ap.add_argument("--hidden-size", type=int)
    ap.add_argument("--seq-length", type=int)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--tensor-model-parallel-size", type=int, default=1)
    ap.add_argument("--context-parallel-size", type=int, default=1)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--cp-comm-type", nargs="+", default=["p2p"])
    return ap


def _positive(name: str, value: int | None) -> int:
    if value is None or value < 1:
        raise ValueError(
            f"--megatron: {name} {value} must be given and >= 1; add it to the Megatron "
            "arguments (megatron-charm-sim reads the attention's shape from them)"
        )
    return value


def layer_from_megatron(text: str, gpus_per_node: int | None) -> MegatronLayer:
    """The layer and CP group of the Megatron-LM arguments ``text`` (one string, shell quoting)
    on nodes of ``gpus_per_node`` GPUs; ``ValueError`` naming the flag for what cannot be read."""
    if gpus_per_node is None or gpus_per_node < 1:
        raise ValueError(
            f"--megatron needs --gpus-per-node (got {gpus_per_node}): the CP group's layout "
            "over the nodes follows from it and the TP and CP sizes; pass e.g. --gpus-per-node 8"
        )
    try:
        args, _ = _parser().parse_known_args(shlex.split(text))
    except (ValueError, SystemExit) as err:  # argparse exits on a value it cannot convert
        raise ValueError(f"--megatron {text!r}: cannot read it ({err}); check its flags") from None
    heads = _positive("--num-attention-heads", args.num_attention_heads)
    groups = args.num_query_groups
    unread: list[str] = []
    if args.group_query_attention:
        kv = _positive("--num-query-groups", 1 if groups is None else groups)  # Megatron's: 1
    else:
        kv = heads
        if groups is not None and groups != heads:
            unread.append(
                f"--num-query-groups {groups} without --group-query-attention, which Megatron "
                "reads only with it (every head its own kv head here); add "
                "--group-query-attention if the model groups its kv heads"
            )
    if heads % kv:
        raise ValueError(
            f"--megatron: --num-attention-heads {heads} must be divisible by --num-query-groups "
            f"{kv}, as Megatron requires"
        )
    if args.kv_channels is not None:
        head_dim = _positive("--kv-channels", args.kv_channels)
    else:
        hidden = _positive("--hidden-size (or --kv-channels)", args.hidden_size)
        if hidden % heads:
            raise ValueError(
                f"--megatron: --hidden-size {hidden} is not divisible by --num-attention-heads "
                f"{heads}; pass --kv-channels, the head dim"
            )
        head_dim = hidden // heads
    tp = _positive("--tensor-model-parallel-size", args.tensor_model_parallel_size)
    cp = _positive("--context-parallel-size", args.context_parallel_size)
    if cp == 1:
        raise ValueError(
            "--megatron: --context-parallel-size is 1 (Megatron's default): no context "
            "parallelism to choose a method for; add the run's --context-parallel-size"
        )
    if gpus_per_node % tp:
        raise ValueError(
            f"--megatron: --tensor-model-parallel-size {tp} must divide --gpus-per-node "
            f"{gpus_per_node}: tensor parallelism stays inside a node"
        )
    slots = gpus_per_node // tp
    p = min(cp, slots)
    if max(cp, slots) % p:
        raise ValueError(
            f"--megatron: --context-parallel-size {cp} and a node's {slots} CP ranks "
            f"(--gpus-per-node {gpus_per_node} / TP {tp}) must divide one another, so that a "
            "CP group holds as many ranks on each of its nodes"
        )
    return MegatronLayer(
        batch=_positive("--micro-batch-size", args.micro_batch_size),
        seq=_positive("--seq-length", args.seq_length),
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        dtype_bytes=2 if args.bf16 or args.fp16 else 4,
        tp=tp,
        nodes=cp // p,
        ranks_per_node=p,
        groups_per_node=gpus_per_node // p,
        cp_comm_types=tuple(dict.fromkeys(args.cp_comm_type)),
        unread=tuple(unread),
    )


#: The simulator's stand-in for a ``--cp-comm-type`` of Transformer Engine: its ``p2p`` is ring
#: attention on the zigzag layout, our ``ring``; its other names are ours too.
SIM_METHOD_OF = {"p2p": "ring"}


def against_current(types: tuple[str, ...], totals: dict[str, float], lead: str) -> str | None:
    """One line on the run's own ``--cp-comm-type`` ``types`` against ``lead``, from the
    predicted forward + backward seconds ``totals`` per method; ``None`` when the run already
    uses ``lead``."""
    parts = []
    for name in types:
        method = SIM_METHOD_OF.get(name, name)
        if method == lead:
            continue
        if name == "auto":
            parts.append("auto picks per layer shape at run time, on --charm-profile")
            continue
        if method not in totals:
            why = "cannot split this shape" if method in METHODS else "is not a method we know"
            parts.append(f"{name} {why}")
            continue
        parts.append(
            f"{name} ({method} here) {totals[method] * 1e3:.3g} ms forward+backward, "
            f"{lead} {totals[lead] * 1e3:.3g} ms: {totals[method] / totals[lead]:.2f}x"
        )
    return f"your run's --cp-comm-type: {'; '.join(parts)}" if parts else None


#: Problem flags that --megatron sets, and their defaults without it.
PROBLEM_FLAGS = {
    "gpus": None,
    "batch": 1,
    "seq": None,
    "heads": None,
    "kv_heads": None,  # --heads
    "head_dim": None,
    "tp": 1,
    "dtype_bytes": 2,
}


def apply_problem_source(args: argparse.Namespace) -> None:
    """Fill the problem flags of ``args`` from ``--megatron`` (with ``--gpus-per-node``), or
    their defaults without it; ``ValueError`` where both give one, or neither a required one."""
    if args.megatron is None:
        if args.gpus_per_node is not None:
            raise ValueError(
                "--gpus-per-node lays out the CP group of --megatron; pass --megatron too, or "
                "--gpus NODESxRANKS"
            )
        required = ("seq", "heads", "head_dim")
        missing = [f"--{k.replace('_', '-')}" for k in required if getattr(args, k) is None]
        if missing:
            raise ValueError(
                f"{', '.join(missing)} missing: give the attention's shape with --seq, --heads "
                "and --head-dim, or pass the run's Megatron-LM arguments with --megatron"
            )
        for key, default in PROBLEM_FLAGS.items():
            if getattr(args, key) is None and default is not None:
                setattr(args, key, default)
        if args.kv_heads is None:  # multi-head attention
            args.kv_heads = args.heads
        args.megatron_line, args.megatron_types = None, ()
        return
    given = [f"--{k.replace('_', '-')}" for k in PROBLEM_FLAGS if getattr(args, k) is not None]
    if given or args.causal:
        flags = given + ["--causal"] * args.causal
        raise ValueError(
            f"{', '.join(flags)} and --megatron both give the problem; drop {', '.join(flags)} "
            "(--megatron sets them, GPT attention causal) or drop --megatron"
        )
    layer = layer_from_megatron(args.megatron, args.gpus_per_node)
    args.gpus = f"{layer.nodes}x{layer.ranks_per_node}"
    args.batch, args.seq, args.head_dim = layer.batch, layer.seq, layer.head_dim
    args.heads, args.kv_heads, args.tp = layer.heads, layer.kv_heads, layer.tp
    args.dtype_bytes, args.causal = layer.dtype_bytes, True
    if args.groups_per_node is None:
        args.groups_per_node = layer.groups_per_node
    args.megatron_types = layer.cp_comm_types
    args.megatron_line = (
        f"from --megatron on {args.gpus_per_node} GPUs per node: CP "
        f"{layer.nodes * layer.ranks_per_node} as {layer.nodes} node(s) x {layer.ranks_per_node} "
        f"rank(s) (--gpus {args.gpus}), batch {layer.batch}, seq {layer.seq}, {layer.heads} "
        f"heads ({layer.kv_heads} kv) of {layer.head_dim}, {layer.dtype_bytes} bytes per "
        f"element, causal, TP {layer.tp}, {layer.groups_per_node} CP group(s) per node"
        + "".join(f"; not read: {note}" for note in layer.unread)
    )
