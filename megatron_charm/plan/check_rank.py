"""What one rank can check of its own program, without anyone else's.

Note [Checking one rank]
~~~~~~~~~~~~~~~~~~~~~~~~
:func:`megatron_charm.plan.validate.validate` replays every rank's program together: it proves
that sends meet receives, that nothing hangs and that every block is computed once. That replay
costs O(cp_size^2), like building every program, so a rank of a large CP group (above
:data:`megatron_charm.function.FULL_CHECK_MAX_CP`) plans only itself (Note [Planning one rank]
in :mod:`megatron_charm.plan`) and runs this check instead, in O(its instructions):

* every wait names an exchange posted before and not waited yet; every exchange is waited;
* every compute uses q and kv that the rank owns or has received (and waited for), with parts
  its block allows;
* every input it sends on, it holds; every partial it sends, it holds with the part it names, in
  the precision its history decides (Note [Wire precision]);
* every merge takes a partial that a waited exchange received, with the part it names;
* at the end it holds no partial of another rank, and its own results cover its sequence.

What needs other ranks (matching, deadlock freedom, every block exactly once) is proved by the
full replay, which the tests run on a grid of layouts for every method, and which
``python -m megatron_charm.plan.render --validate`` runs for any one group offline.
"""

from __future__ import annotations

from megatron_charm.plan.keep import held_input
from megatron_charm.plan.layout import block_empty, block_parts
from megatron_charm.plan.types import (
    Compute,
    Exchange,
    Heads,
    Kind,
    Merge,
    Part,
    Payload,
    Program,
    Wait,
)
from megatron_charm.plan.validate import ScheduleError
from megatron_charm.plan.wire import partial_wire, placed, sent_counts

Key = tuple[Kind, int, Heads | None]


def check_rank_program(
    prog: Program, backward: bool, causal: bool, seq_layout: str, compact: frozenset[str]
) -> None:
    """Check ``prog`` on its own (Note [Checking one rank]); raise :class:`ScheduleError`."""
    x = prog.cp_rank
    qk = Kind.QB if backward else Kind.Q
    inputs: dict[Key, Part] = {(qk, x, None): Part.FULL, (Kind.KV, x, None): Part.FULL}
    acc: dict[Key, Part] = {}  # accumulator -> the part it covers
    held = sent_counts(prog, backward)  # what each sent partial holds (Note [Wire precision])
    # exchange -> its receives (peer, payload), in order; a dict so that a doubled receive is
    # found in O(1): an exchange of tasp receives from every peer
    posted: dict[int, dict[tuple[int, Payload], None]] = {}
    received: set[tuple[int, int, Payload]] = set()  # waited partials: (exchange, peer, payload)

    def err(pc: int, msg: str) -> ScheduleError:
        return ScheduleError(f"cp_rank {x}, instr {pc}: {msg}")

    def has(kind: Kind, owner: int, part: Part, heads: Heads | None) -> bool:
        if owner == x:
            return True
        got = inputs.get((kind, owner, None))
        if got is not None and got.contains(part):
            return True
        got = inputs.get((kind, owner, heads))
        return got is not None and got.contains(part)

    def add(key: Key, part: Part) -> None:
        have = acc.get(key)
        acc[key] = part if have is None else have.union(part)

    for pc, ins in enumerate(prog.instrs):
        if isinstance(ins, Exchange):
            if ins.handle in posted:
                raise err(pc, f"posts exchange {ins.handle} twice")
            posted[ins.handle] = {}
            for k, op in enumerate(ins.ops):
                p = op.payload
                if op.peer == x:
                    raise err(pc, f"exchanges {p} with itself")
                if not op.send:
                    if (op.peer, p) in posted[ins.handle]:
                        raise err(pc, f"receives {p} twice from cp_rank {op.peer} in one exchange")
                    posted[ins.handle][(op.peer, p)] = None
                elif not p.kind.is_partial:
                    if not has(held_input(p.kind), p.owner, p.part, p.heads):
                        raise err(pc, f"sends {p} that it does not hold")
                else:
                    have = acc.pop((p.kind, p.owner, p.heads), None)
                    if have != p.part:
                        raise err(pc, f"sends {p} but holds {have}")
                    blocks = held[(ins.handle, k)]
                    if op.wire != partial_wire(blocks, placed(op, x), ins.channel in compact):
                        raise err(pc, f"sends {p} ({blocks} blocks) in {op.wire.value}")
        elif isinstance(ins, Wait):
            if ins.handle not in posted:
                raise err(pc, f"waits for exchange {ins.handle}, never posted or waited twice")
            for peer, p in posted.pop(ins.handle):
                if p.kind.is_partial:
                    received.add((ins.handle, peer, p))
                else:  # a DB completes the bundle with a kept q (checked by the replay)
                    inputs[(held_input(p.kind), p.owner, p.heads)] = p.part
        elif isinstance(ins, Compute):
            if block_empty(ins.q_owner, ins.kv_owner, causal, seq_layout):
                raise err(pc, f"computes the empty block ({ins.q_owner},{ins.kv_owner})")
            qp, kp, masked = block_parts(ins.q_owner, ins.kv_owner, causal, seq_layout)
            if masked != ins.masked or not (qp.contains(ins.q_part) and kp.contains(ins.kv_part)):
                raise err(pc, f"block ({ins.q_owner},{ins.kv_owner}) uses wrong parts")
            for need in ((qk, ins.q_owner, ins.q_part), (Kind.KV, ins.kv_owner, ins.kv_part)):
                if not has(*need, ins.heads):
                    raise err(pc, f"computes with {Payload(*need, ins.heads)} not received")
            if backward:
                add((Kind.DQ, ins.q_owner, ins.heads), ins.q_part)
                add((Kind.DKV, ins.kv_owner, ins.heads), ins.kv_part)
            else:
                add((Kind.O, ins.q_owner, ins.heads), ins.q_part)
        elif isinstance(ins, Merge):
            got = (ins.handle, ins.peer, ins.payload)
            if got not in received:
                raise err(
                    pc,
                    f"merges {ins.payload} from cp_rank {ins.peer}, which exchange {ins.handle} "
                    "did not deliver",
                )
            received.discard(got)
            p = ins.payload
            add((p.kind, p.owner, p.heads), p.part)
    if posted:
        raise ScheduleError(f"cp_rank {x} never waits for exchanges {sorted(posted)}")
    if received:
        raise ScheduleError(f"cp_rank {x} never merges {sorted(str(p) for _, _, p in received)}")
    kinds = (Kind.DQ, Kind.DKV) if backward else (Kind.O,)
    for key, part in acc.items():
        if key[1] != x or key[0] not in kinds:
            raise ScheduleError(f"cp_rank {x} ends holding the partial {key} of another rank")
        if part != Part.FULL:
            raise ScheduleError(f"cp_rank {x} ends with {key} covering only {part.value}")
    for kind in kinds:
        if not any(k[0] == kind for k in acc):
            raise ScheduleError(f"cp_rank {x} ends without its {kind.value}")
