"""The scaling study's rows and text (megatron_charm/sim/scaling.py)."""

import pytest

from megatron_charm.sim import scaling
from megatron_charm.sim.programs import SYMMETRIC_ERROR


def test_the_link_setups_follow_the_gpus_per_node():
    assert [scaling.nics_per_node(s, 4) for s in scaling.setups(4)] == [4, 2, 1]
    # on two GPUs a node one NIC per GPU is two per node: the setup is not swept twice
    assert scaling.setups(2) == ["rails", "shared"]


def test_rows_and_text_take_the_gpus_per_node_and_the_known_replay_error(tmp_path):
    rows = scaling.run(256, 0.68, (2,), p=2)
    assert [(r["model"], r["cross_links"]) for r in rows] == [
        (shape.name, links) for shape in scaling.SHAPES for links in ("rails", "shared")
    ]
    assert all(r["gpus"] == 4 and r["seq"] == 256 * 4 for r in rows)
    # two links a node (rails) against one shared: the shared link is never faster
    for rails, shared in zip(rows[::2], rows[1::2], strict=True):
        assert shared["ring_fwd_ms"] >= rails["ring_fwd_ms"]
    path = tmp_path / "s.md"
    scaling.write_markdown(rows, str(path), "cmd", p=2)
    text = path.read_text()
    assert "batch 1, 2 GPUs per node" in text and "with 2 or 1 cross links" in text
    for method in scaling.SHOWN:
        assert f"up to {SYMMETRIC_ERROR[method]:.0%} for {method}" in text
    assert "more than 64 nodes" in text  # 128 ranks in full, on nodes of 2


def test_a_node_without_gpus_is_refused():
    with pytest.raises(SystemExit):
        scaling.main(["--gpus-per-node", "0", "--nodes", "2"])
