"""The call agreement's reduction (Note [Call agreement]): fingerprints whose negation fits an
int64, and the MIN-reduction of ``[fp, -fp]`` read as 'all equal'."""

from __future__ import annotations

import dataclasses

import torch

from megatron_charm.comm.agreement import CallKey, agreed
from megatron_charm.plan import PlanOptions

INT64_MAX = torch.iinfo(torch.int64).max


def _key(**change) -> CallKey:
    key = CallKey((8, 1, 4, 8), 4, "torch.float32", True, 0.35, PlanOptions())
    return dataclasses.replace(key, **change)


def _reduce(fingerprints: list[int]) -> tuple[int, int]:
    """What the group's all_reduce(MIN) of each rank's ``[fp, -fp]`` gives, computed in int64."""
    rows = torch.tensor([[fp, -fp] for fp in fingerprints], dtype=torch.int64)
    smallest, minus_largest = rows.min(dim=0).values.tolist()
    return smallest, minus_largest


def test_fingerprints_are_63_bit_and_distinguish_keys():
    keys = [_key(), _key(causal=False), _key(local_shape_sbhd=(12, 1, 4, 8)), _key(mask="m")]
    prints = [k.fingerprint() for k in keys]
    assert all(0 <= fp <= INT64_MAX for fp in prints), prints
    assert len(set(prints)) == len(prints)
    assert _key().fingerprint() == prints[0]


def test_min_reduction_agrees_only_when_every_fingerprint_is_equal():
    a, b = _key().fingerprint(), _key(causal=False).fingerprint()
    assert agreed(*_reduce([a, a, a, a]))
    for odd in range(4):
        mixed = [b if i == odd else a for i in range(4)]
        assert not agreed(*_reduce(mixed)), mixed
    # the extremes of the range: negation stays inside int64
    assert agreed(*_reduce([INT64_MAX, INT64_MAX]))
    assert agreed(*_reduce([0, 0]))
    assert not agreed(*_reduce([0, INT64_MAX]))
