"""The testbed on the real kernel: namespaces, shaping, launcher, teardown (root only)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from megatron_charm.testbed import Testbed, TestbedError, netem_available
from megatron_charm.testbed.config import NAME_PREFIX
from megatron_charm.testbed.net import check_prerequisites, list_namespaces
from megatron_charm.testbed.probe import probe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _usable() -> str | None:
    try:
        check_prerequisites()
    except TestbedError as exc:
        return str(exc)
    return None


_WHY_NOT = _usable()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"testbed unusable: {_WHY_NOT}")


def _name(tag: str) -> str:
    # Unique per process, so concurrent test runs on one host do not collide.
    return f"t{os.getpid()}{tag}"


def _left(name: str) -> list[str]:
    return list_namespaces(f"{NAME_PREFIX}{name}-")


def test_gloo_cross_transfer_is_rate_limited() -> None:
    name = _name("rate")
    with Testbed(nodes=2, ranks_per_node=1, cross_rate="20mbit", name=name) as tb:
        assert len(_left(name)) == 2
        result = probe(tb, cross_bytes=2_000_000, repeats=2, timeout_s=90)
    assert _left(name) == []
    (cross,) = result["phases"]
    assert cross["name"] == "cross" and cross["pairs"] == [(0, 1)]
    expected_s = 2_000_000 * 8 / 20e6  # 0.8 s at 20 Mbit/s
    # Loose: headers cost ~1%, the first token bucket burst saves a little, CPU noise adds some.
    assert 0.8 * expected_s < cross["seconds_median"] < 1.5 * expected_s
    assert 0.65 < cross["per_link_vs_configured"] < 1.15


def test_env_and_paths_rails() -> None:
    """Each rank sees torchrun-style env; same-rail peers are over rail veths, local ones on lo."""
    script = (
        'echo "$RANK $LOCAL_RANK $LOCAL_WORLD_SIZE $WORLD_SIZE $GROUP_RANK $MEGATRON_CHARM_NODE_ID '
        '$GLOO_SOCKET_IFNAME $MASTER_ADDR $MEGATRON_CHARM_TESTBED_CROSS_BPS"; '
        'for a in 198.18.1.1 198.18.1.2 198.18.2.1 198.18.2.2; do ip -o route get "$a"; done'
    )
    with Testbed(
        nodes=2, ranks_per_node=2, topology="rails", cross_rate="50mbit", name=_name("env")
    ) as tb:
        res = tb.run(["sh", "-c", script], timeout_s=30, capture=True).check()
    node_ids = set()
    for r in res.ranks:
        head, *route_lines = r.stdout.strip().splitlines()
        rank, local, lws, world, node, node_id, ifname, master, bps = head.split()
        assert (int(rank), int(local), int(node)) == (r.global_rank, r.local, r.node)
        assert (lws, world, ifname, master, bps) == (
            "2",
            "4",
            f"r{r.local}",
            "198.18.1.1",
            "50000000",
        )
        node_ids.add((r.node, node_id))
        for line in route_lines:
            dst = line.split()[0] if not line.startswith("local") else line.split()[1]
            dst_node, dst_local = (int(x) - 1 for x in dst.split(".")[2:])
            if dst_node == r.node:
                assert " dev lo " in line, line
            else:  # destination rail decides the link
                assert f" dev n{dst_node}r{dst_local} " in line, line
    assert len({nid for _, nid in node_ids}) == 2 and len(node_ids) == 2


def test_failing_rank_stops_the_others() -> None:
    script = 'if [ "$RANK" = 1 ]; then exit 3; fi; sleep 30'
    with Testbed(nodes=2, cross_rate="100mbit", name=_name("fail")) as tb:
        res = tb.run(["sh", "-c", script], timeout_s=60)
        late = tb.run(["sleep", "30"], timeout_s=1.0)
    assert not res.ok and res.first_failure == 1
    assert res.ranks[1].returncode == 3 and not res.ranks[1].killed
    assert res.ranks[0].killed and res.ranks[0].returncode != 0
    assert res.elapsed_s < 10
    with pytest.raises(TestbedError, match="rank 1 exited with 3"):
        res.check()
    assert late.timed_out and all(r.killed for r in late.ranks) and late.elapsed_s < 8


def test_teardown_on_exception() -> None:
    name = _name("exc")
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(nodes=3, cross_rate="1gbit", name=name):
            assert len(_left(name)) == 3
            raise RuntimeError("boom")
    assert _left(name) == []


def test_teardown_on_sigterm() -> None:
    name = _name("term")
    code = textwrap.dedent(f"""
        import time
        from megatron_charm.testbed import Testbed
        with Testbed(nodes=2, cross_rate="1gbit", name={name!r}):
            print("up", flush=True)
            time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "up"
        assert len(_left(name)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert _left(name) == []


def test_cli_up_run_down() -> None:
    name = _name("cli")
    cli = [sys.executable, "-m", "megatron_charm.testbed"]
    env = dict(os.environ, PYTHONPATH=REPO)

    def call(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=60)

    try:
        up = call(
            "up",
            "--name",
            name,
            "--nodes",
            "2",
            "--ranks-per-node",
            "2",
            "--topology",
            "shared",
            "--cross-rate",
            "30mbit",
        )
        assert up.returncode == 0, up.stderr
        assert "30 Mbit/s" in up.stdout and len(_left(name)) == 2
        again = call("up", "--name", name, "--cross-rate", "30mbit")
        assert again.returncode == 2 and "already exists" in again.stderr
        run = call("run", "--name", name, "--", "sh", "-c", 'echo "rank=$RANK"')
        assert run.returncode == 0, run.stderr
        assert sorted(run.stdout.split()) == [f"rank={r}" for r in range(4)]
        bad = call("run", "--name", name, "--", "sh", "-c", "exit 5")
        assert bad.returncode == 5
    finally:
        down = call("down", "--name", name)
    assert down.returncode == 0 and _left(name) == []
    missing = call("run", "--name", name, "--", "true")
    assert missing.returncode == 2 and "no testbed named" in missing.stderr


def test_cli_state_dir_names_where_a_testbed_is_found(tmp_path) -> None:
    # --state-dir is data: a testbed brought up with one is found there, and only there
    name = _name("sdir")
    cli = [sys.executable, "-m", "megatron_charm.testbed"]
    env = dict(os.environ, PYTHONPATH=REPO)
    state = str(tmp_path / "state")

    def call(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=60)

    try:
        up = call("up", "--name", name, "--state-dir", state, "--cross-rate", "30mbit")
        assert up.returncode == 0, up.stderr
        assert os.path.exists(os.path.join(state, f"{name}.json"))
        run = call("run", "--name", name, "--state-dir", state, "--", "true")
        assert run.returncode == 0, run.stderr
        elsewhere = call("run", "--name", name, "--", "true")  # the default directory
        assert elsewhere.returncode == 2 and "no testbed named" in elsewhere.stderr
    finally:
        down = call("down", "--name", name, "--state-dir", state)
    assert down.returncode == 0 and _left(name) == []
    assert not os.path.exists(os.path.join(state, f"{name}.json"))


def test_refuses_to_reuse_a_live_name() -> None:
    name = _name("dup")
    with Testbed(nodes=2, cross_rate="1gbit", name=name):
        with pytest.raises(TestbedError, match="already exists"):
            Testbed(nodes=2, cross_rate="1gbit", name=name).up()
        assert len(_left(name)) == 2  # the failed second build did not remove the first
    assert _left(name) == []


def test_cross_delay_needs_netem() -> None:
    name = _name("delay")
    tb = Testbed(nodes=2, cross_rate="100mbit", cross_delay="2ms", name=name)
    if netem_available():
        with tb:
            ns = tb.namespaces[0]
            qdiscs = subprocess.run(
                ["tc", "-n", ns, "qdisc", "show", "dev", "n1"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "tbf" in qdiscs and "netem" in qdiscs
    else:
        with pytest.raises(TestbedError, match="netem"):
            tb.up()
    assert _left(name) == []


def _class_counts(ns: str, dev: str) -> dict[str, tuple[int, int]]:
    """``classid -> (bytes, packets)`` sent by each HTB class on ``dev``."""
    import re

    text = subprocess.run(
        ["tc", "-s", "-n", ns, "class", "show", "dev", dev],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    got = re.findall(r"class htb (\S+) .*?\n\s*Sent (\d+) bytes (\d+) pkt", text)
    return {cid: (int(b), int(p)) for cid, b, p in got}


@pytest.mark.parametrize("ack_priority", [True, False], ids=["acks-first", "one-fifo"])
def test_acknowledgements_go_ahead_of_data(ack_priority: bool) -> None:
    """Note [Acknowledgements first]: small packets leave through the HTB class served first,
    data through the other; without the option the link has the tbf's single queue."""
    name = _name("acks" if ack_priority else "fifo")
    cfg = dict(nodes=2, ranks_per_node=1, cross_rate="50mbit", name=name)
    with Testbed(**cfg, ack_priority=ack_priority) as tb:
        probe(tb, cross_bytes=1_000_000, repeats=1, timeout_s=90)
        counts = [_class_counts(ns, "n1" if node == 0 else "n0")
                  for node, ns in enumerate(tb.namespaces)]  # fmt: skip
    assert _left(name) == []
    if not ack_priority:
        assert counts == [{}, {}]
        return
    small = [c["10:10"] for c in counts]
    data = [c["10:20"] for c in counts]
    assert sum(p for _, p in small) > 100, counts  # the receivers' acknowledgements
    assert all(b <= 128 * p for b, p in small), counts  # and nothing larger
    assert sum(b for b, _ in data) >= 1_000_000, counts  # the probe's data


def test_a_measurement_script_runs_as_every_rank_and_hands_back_json(tmp_path) -> None:
    # megatron_charm/testbed/script.py: the scripts of scripts/bench that measure on the testbed
    from megatron_charm.testbed.script import run_script_ranks

    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch.distributed as dist
            from megatron_charm.testbed.script import gather_to_file
            assert sys.argv[1] == "--rank-out"
            dist.init_process_group("gloo")
            gather_to_file([dist.get_rank(), sys.argv[3:]], sys.argv[2])
            """
        )
    )
    got = run_script_ranks(str(script), ["a", "7"], 2, 2, "100mbit", "rails", timeout_s=120)
    assert got == [[r, ["a", "7"]] for r in range(4)]
    with pytest.raises(RuntimeError, match=r"(?s)ranks\.py on 1 x 2 failed .*nodes=1"):
        run_script_ranks(str(script), [], 1, 2, "100mbit", timeout_s=60)
