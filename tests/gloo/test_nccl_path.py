"""The NCCL-relevant parts of the topology, run on gloo (the same code): every channel group's
pairs are connected at build, in one exchange per group, and every group carries the timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_charm.comm.topology import warm_pairs
from megatron_charm.plan import Layout
from tests.gloo import nccl_path_tasks


@pytest.mark.gloo
@pytest.mark.parametrize("p", [2, 4], ids=["2x2", "1x4"])
def test_build_connects_every_channel_pair_and_sets_timeouts(pools, p):
    n, timeout_s = 4, 321.0
    got = pools(n).run(nccl_path_tasks.warm_up_contacts, ranks_per_node=p, timeout_s=timeout_s)
    layout = Layout(n // p, p)
    pairs = warm_pairs(layout)
    for cp_rank, ops, timeouts in got:
        # with one node the intra channels are the full groups, warmed once under that name
        def group_of(channel):
            return channel.replace("intra", "full") if layout.num_nodes == 1 else channel

        want = sorted(
            {
                (group_of(c), b if a == cp_rank else a, send)
                for c, a, b in pairs
                if cp_rank in (a, b)
                for send in (False, True)
            }
        )
        assert ops == want, f"cp_rank {cp_rank}"
        assert set(timeouts.values()) == {timeout_s}, timeouts


@pytest.mark.gloo
def test_build_counts_the_cp_groups_that_share_each_node(pools):
    """TP 2 puts two CP groups on every node, and ``auto`` shares the node's links among them;
    one host that emulates nodes for one CP group still holds one group."""
    for layout, interleaved, whole, chosen in pools(4).run(nccl_path_tasks.groups_on_nodes):
        assert layout == Layout(2, 1)
        assert (interleaved, whole) == (2, 1)
        assert chosen == [2]  # cp_attention's auto chose with the interleaved group's count


@pytest.mark.gloo
@pytest.mark.parametrize("method,p,h", [("charm", 2, 4), ("ring", 4, 4), ("a2a", 4, 8)])
def test_gqa_kv_expanded_once_per_delivery_without_native_gqa(pools, method, p, h):
    h_kv = h // 2
    groups = 4 if method == "a2a" else 1  # a2a computes on one head group of four per rank
    got = pools(4).run(
        nccl_path_tasks.gqa_expansions, method=method, ranks_per_node=p, h=h, h_kv=h_kv
    )
    for cp_rank, answers in enumerate(got):
        expanded, native = answers[False], answers[True]
        # k and v of every kv delivery are expanded once, however many blocks use it
        assert expanded["expansions"] == [2 * n for n in expanded["deliveries"]], cp_rank
        assert expanded["heads"] == [h // groups]
        assert native["expansions"] == [0, 0] and native["heads"] == [h_kv // groups]
        for a, b in zip(expanded["results"], native["results"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        # the expanded copies are buffers of the pass
        assert all(e > n for e, n in zip(expanded["peak"], native["peak"], strict=True))


@pytest.mark.gloo
@pytest.mark.parametrize("method,p", [("charm", 2), ("ring", 4), ("a2a+p2p", 2)])
def test_every_exchange_posts_its_receives_before_its_sends(pools, method, p):
    # Note [Receives first] in megatron_charm/comm/executor.py: gloo issues a batch in order
    got = pools(4).run(nccl_path_tasks.exchange_post_order, method=method, ranks_per_node=p)
    for cp_rank, batches in enumerate(got):
        assert batches and any(False in b and True in b for b in batches), cp_rank
        for sends in batches:
            assert sends == sorted(sends), (cp_rank, sends)  # every False before every True


def _runs(exchange_batches: list[list], runs: list[int]) -> list[list[list]]:
    """The batches of exchanges posted one batch each (NCCL's order), grouped by run."""
    it = iter(exchange_batches)
    grouped = [[next(it) for _ in range(n)] for n in runs]
    assert next(it, None) is None
    return grouped


@pytest.mark.gloo
@pytest.mark.parametrize(
    "method,p,h_kv",
    [("all_gather", 2, 4), ("charm", 2, 4), ("a2a", 4, 4), ("charm", 2, 2), ("a2a+p2p", 2, 2)],
    ids=["all_gather", "charm", "a2a", "charm-gqa", "a2a+p2p-gqa"],
)
def test_gloo_posts_every_receive_of_a_run_before_its_sends(pools, method, p, h_kv):
    # Note [Receives of a run first] in megatron_charm/comm/executor.py
    got = pools(4).run(nccl_path_tasks.run_post_orders, method=method, ranks_per_node=p, h_kv=h_kv)
    for cp_rank, answers in enumerate(got):
        gloo, nccl, runs = answers["gloo"], answers["nccl"], answers["runs"]
        # NCCL's order: one batch per exchange, its receives first
        assert len(nccl["batches"]) == sum(runs), cp_rank
        assert all(b == sorted(b, key=lambda op: op[0]) for b in nccl["batches"]), cp_rank
        posted = [op for b in gloo["batches"] for op in b]
        start = 0
        for run in _runs(nccl["batches"], runs):
            want = [op for b in run for op in b]
            mine = posted[start : start + len(want)]
            start += len(want)
            if len(run) > 1:  # every receive, then every send, each in program order
                want = [op for op in want if not op[0]] + [op for op in want if op[0]]
            assert mine == want, cp_rank
        assert start == len(posted), cp_rank
        # the posting order moves no number
        for a, b in zip(gloo["results"], nccl["results"], strict=True):
            assert torch.equal(a, b), cp_rank
    # every case has a run of several exchanges with a send before a receive
    assert all(a["gloo"]["batches"] != a["nccl"]["batches"] for a in got)


@pytest.mark.gloo
def test_destroy_releases_the_groups_of_a_topology(pools):
    """A topology built again and again in one process keeps neither groups nor sockets once
    each is destroyed, and a destroyed one refuses calls with a ValueError."""
    for before, rounds, error in pools(4).run(nccl_path_tasks.rebuilt_topologies, builds=3):
        assert [groups for groups, _ in rounds] == [before] * 3
        files = [f for _, f in rounds]
        assert files[2] <= files[1], files  # the first round may open the pool's own files
        assert error is not None and "was destroyed" in error and "CPTopology.build" in error


_DESTROY_AFTER_THE_JOB = textwrap.dedent(
    """
    import tempfile, torch, torch.distributed as dist
    import megatron_charm as mc
    dist.init_process_group(
        "gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1
    )
    topo = mc.CPTopology.build(None)
    q = torch.randn(1, 8, 2, 8)
    mc.cp_attention(q, q, q, topo)
    dist.destroy_process_group()
    topo.destroy()
    print("destroyed")
    """
)


@pytest.mark.gloo
def test_destroy_after_the_jobs_own_teardown_does_nothing():
    """A program that ends with ``destroy_process_group()`` and then destroys its topology
    (a context manager's exit, say) ends cleanly: the groups are gone already."""
    proc = subprocess.run(
        [sys.executable, "-c", _DESTROY_AFTER_THE_JOB], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "destroyed" in proc.stdout, proc.stderr[-2000:]
