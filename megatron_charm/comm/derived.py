"""What the runner derives from a program, derived once per program.

Note [Derived once]
~~~~~~~~~~~~~~~~~~~
:class:`~megatron_charm.comm.executor.ProgramRunner` interprets a program step by step. Besides
the instructions it needs what follows from them:

* the steps: single instructions, runs of blocks that one kernel call does, runs of partials that
  one sum folds in (:func:`~megatron_charm.plan.coalesce.steps`);
* where each received input, and each head-expanded kv, is last used, so it is released there
  (:func:`~megatron_charm.plan.memory.release_points`,
  :func:`~megatron_charm.plan.memory.expansion_drops`);
* in the forward, the foreign query pieces its backward keeps
  (:func:`~megatron_charm.plan.keep.kept_pieces`).

All of it depends on the program alone, and every call of one layer shape runs the same
``Program`` object (the plans are cached). Derived at every call, it took 0.65 ms of host time
per forward+backward of charm's programs on 2 x 8 and 1.3 ms on 4 x 8 (one CPU core, 2026-12-07,
docs/results/executor/derived-once.md), as much as 65 of the 20 us enqueues the simulator
charges a GPU host per operation (Note [Enqueue ahead] in :mod:`megatron_charm.sim.engine`),
and a host-bound pass pays it at every layer. So it is cached, keyed by the program's identity:
hashing a ``Program`` hashes every instruction at every lookup, a fifth of deriving it. A cached
entry holds its program, so the identity stays unique while the entry lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megatron_charm.plan.coalesce import steps
from megatron_charm.plan.keep import kept_pieces
from megatron_charm.plan.memory import ExpandKey, Key, expansion_drops, release_points
from megatron_charm.plan.types import Payload, Program


class _Same:
    """A program as a cache key, by identity."""

    __slots__ = ("program",)

    def __init__(self, program: Program) -> None:
        self.program = program

    def __hash__(self) -> int:
        return id(self.program)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.program is self.program


@dataclass(frozen=True)
class PassSteps:
    """A pass's steps and release points (Note [Derived once]); read only."""

    steps: tuple[tuple[int, int], ...]
    """``(start, end)`` of each step, in order."""
    release: dict[int, list[Key]]
    """Instruction index -> received inputs last used there."""
    drops: dict[int, list[ExpandKey]]
    """Instruction index -> head-expanded kv last used there (empty unless ``expand``)."""


def pass_steps(
    program: Program, own: frozenset[Key], backward: bool, coalesce: bool, expand: bool
) -> PassSteps:
    """The steps and release points of ``program`` for a rank holding ``own`` before the pass;
    ``coalesce``: runs of blocks as one kernel call (not under a document mask); ``expand``: the
    runner repeats kv heads for the kernel (Note [GQA expansion])."""
    return _pass_steps(_Same(program), own, backward, coalesce, expand)


@lru_cache(maxsize=256)
def _pass_steps(
    key: _Same, own: frozenset[Key], backward: bool, coalesce: bool, expand: bool
) -> PassSteps:
    program = key.program
    return PassSteps(
        tuple(steps(program.instrs, coalesce)),
        dict(release_points(program, set(own), backward)),
        dict(expansion_drops(program)) if expand else {},
    )


def kept_by(backward: Program) -> frozenset[Payload]:
    """:func:`~megatron_charm.plan.keep.kept_pieces` of the backward program ``backward``,
    derived once (Note [Derived once])."""
    return _kept_by(_Same(backward))


@lru_cache(maxsize=256)
def _kept_by(key: _Same) -> frozenset[Payload]:
    return kept_pieces(key.program)


def clear() -> None:
    """Forget every derived program (tests; plans rebuilt from scratch)."""
    _pass_steps.cache_clear()
    _kept_by.cache_clear()
