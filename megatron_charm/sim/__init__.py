"""Cluster-scale predictions: replay the planner's real schedules on a topology and cost model.

Pure Python (no torch). :func:`predict` runs every method's forward and backward programs through
the event engine (:mod:`megatron_charm.sim.engine`) on a :class:`Topology` and a compute model;
:func:`advise` picks a ``cp_comm_type``. See docs/simulator.md.
"""

from __future__ import annotations

from megatron_charm.sim.compute import CalibratedCompute, FlopsCompute
from megatron_charm.sim.engine import PassResult, RankResult, simulate_pass
from megatron_charm.sim.predict import (
    Advice,
    Prediction,
    Problem,
    advise,
    ccr,
    ccr_parts,
    predict,
)
from megatron_charm.sim.programs import ProgramSet, node_programs, programs
from megatron_charm.sim.topology import PRESETS, Hardware, Topology, parse_gpus

__all__ = [
    "PRESETS",
    "Advice",
    "CalibratedCompute",
    "FlopsCompute",
    "Hardware",
    "PassResult",
    "Prediction",
    "Problem",
    "ProgramSet",
    "RankResult",
    "Topology",
    "advise",
    "ccr",
    "ccr_parts",
    "node_programs",
    "parse_gpus",
    "predict",
    "programs",
    "simulate_pass",
]
