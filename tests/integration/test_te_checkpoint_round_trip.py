"""Checkpoints move between a TE-spec run and a CHARM+ run (``--cp-comm-type p2p`` <-> ``charm``).

On CPU: a CHARM+ GPT model (local spec) loads a simulated TE state dict, whose
``core_attention._extra_state`` entries hold pickled FP8 metadata, and saves them back unchanged;
a local-spec state dict (no extra state) loads into CHARM+, and CHARM+'s loads into the local
spec with only our ``_extra_state`` entries left over. That TE itself reads what we
save is checked against TE's sources in ``tests/contract/test_te_extra_state_contract.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gloo


def test_te_and_local_state_dicts_round_trip_through_charm(pool1):
    (result,) = pool1.run("tests.integration.checkpoint_workloads:round_trips", timeout=300)
    assert result["extra_keys"] == [
        f"decoder.layers.{i}.self_attention.core_attention._extra_state" for i in range(2)
    ]
    assert result["te_into_charm"] == ([], [])
    assert result["same_weights"] and result["back_to_te"]
    assert result["no_state"] == [None, None]
    assert result["local_into_charm"] == ([], [])
    assert result["charm_into_local"] == ([], result["extra_keys"])
