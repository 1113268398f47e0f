"""The one rank launcher: fail-fast, timeouts, signals and the parent-death signal.

Each test checks through /proc that no rank (nor a child a rank started) outlives the launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_charm.constants import DEFAULT_TIMEOUT_S
from megatron_charm.launch import (
    LaunchError,
    LaunchSpec,
    RankInfo,
    describe_exit,
    run,
    run_function,
)
from tests.faults.procs import default_signals

RANKS = str(Path(__file__).with_name("ranks.py"))
RANK_SH = str(Path(__file__).with_name("rank.sh"))
REPO = str(Path(__file__).resolve().parents[2])
BOUND_S = 20.0
"""Seconds within which every process of a stopped launch must be gone."""

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="scans /proc; parent-death signal is Linux-only"
)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _pids(out: Path, nproc: int, wait_s: float = 120.0) -> list[int]:
    """Pids of every rank and of each rank's child, once all ranks have written them (within
    ``wait_s``; with 0, those written so far)."""
    deadline = time.monotonic() + wait_s
    while True:
        files = sorted(out.glob("rank*.pid"))
        if len(files) == nproc or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if wait_s:
        assert len(files) == nproc, f"the ranks did not start in {wait_s} s: {os.listdir(out)}"
    return [int(p) for f in files for p in f.read_text().split()]


def _assert_gone(pids: list[int], bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} survived the launch by {bound_s} s"


def _spec(out: Path, action: str, who: int = -1, nproc: int = 3, **kw) -> LaunchSpec:
    cmd = ["sh", RANK_SH, str(out), action, str(who)]
    return LaunchSpec(cmd=cmd, nproc=nproc, kill_grace_s=1.0, **kw)


def test_rank_exit_code_names_rank_and_stops_the_others(tmp_path):
    result = run(_spec(tmp_path, "exit3", 1))
    assert not result.ok and result.first_failure == 1
    assert result.ranks[1].returncode == 3 and not result.ranks[1].killed
    assert result.ranks[0].killed and result.ranks[2].killed
    with pytest.raises(LaunchError, match=r"rank 1 exited with 3; the other ranks were stopped"):
        result.check()
    _assert_gone(_pids(tmp_path, 3))


def test_rank_killed_by_signal_names_the_signal(tmp_path):
    with pytest.raises(LaunchError, match="rank 2 was killed by SIGKILL"):
        run(_spec(tmp_path, "sigkill", 2)).check()
    _assert_gone(_pids(tmp_path, 3))


def test_timeout_stops_everything_and_says_so(tmp_path):
    result = run(_spec(tmp_path, "wait", nproc=2, timeout_s=3.0))
    assert result.timed_out and all(r.killed for r in result.ranks)
    assert result.elapsed_s < 3.0 + BOUND_S
    with pytest.raises(LaunchError, match=r"timed out after .* \(timeout_s=3\)"):
        result.check()
    _assert_gone(_pids(tmp_path, 2, wait_s=0))


def test_rank_environment_and_prefix(tmp_path):
    spec = LaunchSpec(
        cmd=["sh", RANK_SH, str(tmp_path), "env", "-1"],
        nproc=2,
        env={"OMP_NUM_THREADS": "2", "SHARED": "s"},
        rank_env=lambda r: {"LOCAL_RANK": str(r % 1), "OWN": f"o{r}"},
        prefix=lambda r: ["env", f"PREFIXED={r}"],
    )
    run(spec).check()
    envs = []
    for r in range(2):
        lines = (tmp_path / f"rank{r}.env").read_text().splitlines()
        envs.append(dict(line.split("=", 1) for line in lines if "=" in line))
    port = envs[0]["MASTER_PORT"]
    for r, env in enumerate(envs):
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(r), "2", "2")
        assert (env["LOCAL_RANK"], env["OWN"], env["PREFIXED"]) == ("0", f"o{r}", str(r))
        assert (env["OMP_NUM_THREADS"], env["SHARED"]) == ("2", "s")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == port != "0"
        assert env["MEGATRON_CHARM_INIT_METHOD"] == "env://"


def _start_launcher(
    out: Path, nproc: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S
) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, RANKS, str(out), str(nproc), str(timeout_s)]
    return subprocess.Popen(cmd, env=env, preexec_fn=default_signals)


@pytest.mark.parametrize(
    ("sig", "code"),
    [
        (signal.SIGTERM, -signal.SIGTERM),  # dies of the signal, as without the launcher
        (signal.SIGHUP, -signal.SIGHUP),
        (signal.SIGINT, 130),  # KeyboardInterrupt, which the launcher script turns into 130
    ],
)
def test_signal_to_launcher_leaves_no_rank(tmp_path, sig, code):
    launcher = _start_launcher(tmp_path)
    try:
        pids = _pids(tmp_path, 2)
        launcher.send_signal(sig)
        assert launcher.wait(timeout=BOUND_S) == code
    finally:
        launcher.kill()
        launcher.wait()
    _assert_gone(pids)


def test_sigkilled_launcher_takes_its_ranks_along(tmp_path):
    launcher = _start_launcher(tmp_path)
    try:
        pids = _pids(tmp_path, 2)
        launcher.kill()
        assert launcher.wait(timeout=BOUND_S) == -signal.SIGKILL
    finally:
        launcher.kill()
        launcher.wait()
    # The parent-death signal reaches the ranks only; their own children are not asked here.
    ranks = pids[0::2]
    _assert_gone(ranks)
    for pid in pids[1::2]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _record(info: RankInfo, out: str, fail_rank: int) -> None:
    with open(os.path.join(out, f"fn{info.global_rank}"), "w") as f:
        json.dump([info.global_rank, info.world_size, info.local_rank, info.init_method], f)
    if info.global_rank == fail_rank:
        raise RuntimeError("planned failure")


def test_run_function_passes_rank_info_and_names_failing_rank(tmp_path):
    run_function(_record, str(tmp_path), -1, nproc=2)
    got = [json.loads((tmp_path / f"fn{r}").read_text()) for r in range(2)]
    assert [g[:3] for g in got] == [[0, 2, 0], [1, 2, 1]]
    assert got[0][3] == got[1][3] and got[0][3].startswith("file://")
    with pytest.raises(LaunchError, match="rank 1 exited with 1"):
        run_function(_record, str(tmp_path), 1, nproc=2)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"cmd": []}, "cmd is empty"),
        ({"nproc": 0}, "nproc=0"),
        ({"rendezvous": "mpi"}, "rendezvous='mpi'"),
        ({"rendezvous": "file"}, "store_path"),
        ({"timeout_s": 0}, "timeout_s=0"),
    ],
)
def test_spec_rejects_bad_settings(kw, match):
    args = {"cmd": ["true"], "nproc": 1, **kw}
    with pytest.raises(ValueError, match=match):
        LaunchSpec(**args)


def test_describe_exit():
    assert describe_exit(0) == "exited with 0"
    assert describe_exit(-signal.SIGSEGV) == "was killed by SIGSEGV"
    assert describe_exit(None) == "is still running"


def test_demo_runs_its_ranks_through_the_launcher():
    # The demo's rank function lives in a module run with ``python -m``: the ranks must import
    # it by its real name, not as ``__main__``.
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "megatron_charm.demo", "--ranks", "2", "--ranks-per-node", "1"]
    proc = subprocess.run(
        [*cmd, "--seq", "32"], env=env, capture_output=True, text=True, timeout=DEFAULT_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cp_rank 1: tokens from" in proc.stdout and proc.stdout.rstrip().endswith("OK")


def test_rank_info_still_reads_its_old_field_name_with_a_warning() -> None:
    info = RankInfo(3, 4, 1, "env://")
    with pytest.warns(DeprecationWarning, match="use RankInfo.global_rank"):
        assert info.rank == 3
