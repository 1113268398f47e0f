"""Plain data types of a schedule: what each rank posts, waits for, computes and reduces.

A :class:`Program` is one rank's instruction list for one pass (forward or backward). The executor
interprets it on tensors, :mod:`megatron_charm.plan.validate` replays it symbolically for all ranks
at once, and the simulator replays it on a cost model. No other module decides what is sent or
computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from megatron_charm.plan.options import PlanOptions


class Part(str, Enum):
    """Which part of a rank's local sequence a tensor covers (the zigzag halves of
    docs/design.md, "Layout of the sequence")."""

    FULL = "full"
    FIRST = "first"
    SECOND = "second"

    # Members are singletons: identity tests keep these cheap (a plan at scale calls them
    # millions of times).
    def union(self, other: Part | Chunk) -> Part:
        if self is other or self is Part.FULL:
            return self
        if type(other) is Chunk and other.base is self:
            return self
        return Part.FULL

    def contains(self, other: Part | Chunk) -> bool:
        return self is Part.FULL or self is other or (type(other) is Chunk and other.base is self)

    @property
    def fraction(self) -> float:
        return 1.0 if self is Part.FULL else 0.5


@dataclass(frozen=True, order=True)
class Chunk:
    """Piece ``index`` of ``count`` equal consecutive pieces of ``base``: the kv chunks that
    TASP moves (Note [TASP schedule] in :mod:`megatron_charm.plan.tasp`). It stands wherever a
    :class:`Part` does, with the same interface; only whole parts are ever merged into one."""

    base: Part
    index: int
    count: int

    @property
    def value(self) -> str:
        return f"{self.base.value}{self.index}/{self.count}"

    @property
    def fraction(self) -> float:
        return self.base.fraction / self.count

    def contains(self, other: Part | Chunk) -> bool:
        return self is other or self == other

    def union(self, other: Part | Chunk) -> Part | Chunk:
        """The smallest part covering both: ``self``, ``other``, or (for two different
        chunks) the part that holds them both, which is wider than their union."""
        if other.contains(self):
            return other
        inner = other.base if type(other) is Chunk else other
        return self.base.union(inner)


_CHUNKS: dict[tuple[Part, int, int], Chunk] = {}


def chunk(part: Part, index: int, count: int) -> Part | Chunk:
    """Piece ``index`` of ``count`` of ``part``; ``part`` itself when ``count`` is 1."""
    if count == 1:
        return part
    # one instance per chunk: a tasp program names (cp_size - 1)^2 of them, and building a
    # frozen dataclass costs more than looking one up
    key = (part, index, count)
    got = _CHUNKS.get(key)
    if got is None:
        got = _CHUNKS[key] = Chunk(part, index, count)
    return got


class Kind(str, Enum):
    """What a payload carries.

    Partial results (O, DQ, DKV) are accumulators: the sender gives them up when it sends them.
    """

    Q = "q"  # query part, [s_part, b, h, d]
    KV = "kv"  # key and value parts, 2 x [s_part, b, h_kv, d]
    O = "o"  # noqa: E741 - partial output and lse of one query: [s_part, b, h, d] and float32 [s_part, b, h]
    # backward query bundle: q, dout ([s_part, b, h, d] each), lse and delta (float32
    # [s_part, b, h] each; Note [The backward bundle] in megatron_charm/kernels/delta.py)
    QB = "qb"
    # the backward bundle without q: dout, lse and delta, for a query piece that its receiver
    # kept from the forward (Note [Keeping foreign queries] in megatron_charm/plan/keep.py)
    DB = "db"
    DQ = "dq"  # partial gradient of a query, [s_part, b, h, d]
    DKV = "dkv"  # partial gradients of key and value, 2 x [s_part, b, h_kv, d]

    @property
    def is_partial(self) -> bool:
        return self is Kind.O or self is Kind.DQ or self is Kind.DKV


class Wire(str, Enum):
    """Precision a payload travels in. The planner decides it for every op (see
    :mod:`megatron_charm.plan.wire`); the executor and the simulator read it."""

    INPUT = "input"  # the input dtype (the lse of an output is float32 in either case)
    FP32 = "fp32"


@dataclass(frozen=True)
class Heads:
    """Head group ``index`` of ``count`` equal groups: query heads
    ``[index * h / count, (index + 1) * h / count)`` and kv heads likewise of ``h_kv``."""

    index: int
    count: int

    @property
    def fraction(self) -> float:
        return 1.0 / self.count

    def of(self, heads: int) -> slice:
        """The slice of a ``heads``-head dim that this group covers (``heads % count == 0``)."""
        size = heads // self.count
        return slice(self.index * size, (self.index + 1) * size)

    def __str__(self) -> str:
        return f"h{self.index}/{self.count}"


def head_fraction(heads: Heads | None) -> float:
    """Share of the heads a payload or block covers (``None``: all heads)."""
    return 1.0 if heads is None else heads.fraction


@dataclass(frozen=True)
class Payload:
    """A named tensor bundle: ``kind`` of CP rank ``owner``, restricted to ``part`` and to the
    head group ``heads`` (``None``: all heads)."""

    kind: Kind
    owner: int
    part: Part | Chunk
    heads: Heads | None = None

    def __str__(self) -> str:
        tail = "" if self.heads is None else f".{self.heads}"
        return f"{self.kind.value}{self.owner}.{self.part.value}{tail}"


@dataclass(frozen=True)
class Op:
    """One send or receive inside an :class:`Exchange`."""

    send: bool
    peer: int  # CP rank
    payload: Payload
    wire: Wire = Wire.INPUT
    held: int = 0
    """On the receive of a partial: how many blocks the sender's accumulator holds when it sends
    (a merged partial counts 2), as the schedule generator knows it. It lets a rank decide its
    receive's wire precision from its own program (Note [Wire precision]); 0 elsewhere."""
    merged: bool = False
    """On both sides of a head-group partial that goes to its owner: the owner merges it with
    its own blocks instead of placing it complete into its head slice (``a2a+charm``'s returns
    across nodes, Note [A2a+charm schedule]). Such a partial is not complete, so it follows the
    rule of merged partials, not of placed ones (Note [Wire precision])."""


@dataclass(frozen=True)
class Exchange:
    """Post a group of sends and receives on one channel; never blocks.

    Ops of one exchange are issued together (``batch_isend_irecv``); on NCCL the exchanges of one
    channel run in posting order, so every rank must post matching exchanges in the same order.
    """

    handle: int
    channel: str
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Wait:
    """Block until exchange ``handle`` is complete; received payloads become usable."""

    handle: int


@dataclass(frozen=True)
class Compute:
    """Attention of query ``q_owner`` (restricted to ``q_part``) against kv of ``kv_owner``
    (restricted to ``kv_part``), causal-masked on local positions when ``masked``, on the head
    group ``heads`` (``None``: all heads).

    Forward: merged into this rank's output accumulator of ``(q_owner, heads)``. Backward: adds
    to this rank's dq accumulator of ``(q_owner, heads)`` and dkv accumulator of
    ``(kv_owner, heads)``.
    """

    q_owner: int
    kv_owner: int
    q_part: Part
    kv_part: Part | Chunk
    masked: bool
    heads: Heads | None = None


@dataclass(frozen=True)
class Merge:
    """Fold the partial result ``payload`` (``O``, ``DQ`` or ``DKV``) that exchange ``handle``
    received from ``peer`` (a CP rank) into the local accumulator of ``(kind, owner, heads)``
    (outputs by their lse, gradients by a sum). A head-group partial is complete for its heads
    (Note [Wire precision]): it starts its own accumulator, which the owner places into its head
    slice at the end.

    ``peer`` tells apart partials of one payload that one exchange receives from several ranks
    (``tasp`` returns every peer's dk/dv chunk of a step in one exchange)."""

    payload: Payload
    handle: int
    peer: int


Instr = Exchange | Wait | Compute | Merge


@dataclass(frozen=True)
class Program:
    """Instruction list of one rank for one pass (immutable: plans are cached and shared)."""

    cp_rank: int
    instrs: tuple[Instr, ...] = ()

    def exchanges(self) -> list[Exchange]:
        return [i for i in self.instrs if isinstance(i, Exchange)]

    def computes(self) -> list[Compute]:
        return [i for i in self.instrs if isinstance(i, Compute)]

    def without_overlap(self) -> Program:
        """The same instructions with each ``Wait`` moved up to right after its ``Exchange``:
        nothing computes while a transfer is in flight (the paper's sequential runs for its CCR,
        and its Ring-Attention forward). An exchange never waited for gets no wait."""
        waited = {i.handle for i in self.instrs if isinstance(i, Wait)}
        instrs: list[Instr] = []
        for ins in self.instrs:
            if isinstance(ins, Wait):
                continue
            instrs.append(ins)
            if isinstance(ins, Exchange) and ins.handle in waited:
                instrs.append(Wait(ins.handle))
        return Program(self.cp_rank, tuple(instrs))


@dataclass(frozen=True)
class Layout:
    """A CP group as ``num_nodes`` (m) nodes of ``ranks_per_node`` (p) consecutive CP ranks."""

    num_nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        # bool is an int subclass, and Layout(True, 8) is a typo rather than a layout.
        if not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 1
            for x in (self.num_nodes, self.ranks_per_node)
        ):
            raise ValueError(
                f"Layout(num_nodes={self.num_nodes!r}, ranks_per_node={self.ranks_per_node!r}): "
                "both must be integers >= 1; pass e.g. Layout(2, 8) / --gpus 2x8"
            )

    @property
    def cp_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def node(self, cp_rank: int) -> int:
        return cp_rank // self.ranks_per_node

    def local(self, cp_rank: int) -> int:
        return cp_rank % self.ranks_per_node

    def rank(self, node: int, local: int) -> int:
        return node * self.ranks_per_node + local


@dataclass(frozen=True)
class Plan:
    """Forward and backward programs of every rank of a CP group (immutable)."""

    options: PlanOptions
    layout: Layout
    """The CP group's node layout (methods other than charm schedule it as one flat group)."""
    causal: bool
    forward: tuple[Program, ...]
    backward: tuple[Program, ...]
    channels: tuple[tuple[str, str], ...]
    """``(channel name, scope)`` of every channel the programs use; scope ``intra``, ``cross`` or
    ``full`` (see :mod:`megatron_charm.comm.topology`)."""
    cross: tuple[str, str] = ("q", "q")
    """What crosses nodes in the forward and in the backward pass (charm): ``q``, ``kv``, or in
    the backward ``dout`` (q crossed in the forward and was kept: the bundles ship dout, lse and
    delta; Note [Keeping foreign queries])."""
    intra: tuple[str, str] = ("split", "split")
    """What charm's ranks exchange inside a node in each pass: ``split`` (RM+) or ``kv``."""
    pattern: frozenset[tuple[int, Part, int, Part]] | None = None
    """The non-empty half blocks ``(q cp_rank, q half, kv cp_rank, kv half)`` of the mask the
    plan was pruned to (:mod:`megatron_charm.plan.prune`); ``None``: a dense plan."""

    @property
    def method(self) -> str:
        return self.options.method

    def programs(self, backward: bool) -> tuple[Program, ...]:
        return self.backward if backward else self.forward
