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

from megatron_charm.launch import (
    LaunchError,
    LaunchSpec,
    RankInfo,
    describe_exit,
    run,
    run_function,
)

RANKS = str(Path(__file__).with_name("ranks.py"))
REPO = str(Path(__file__).resolve().parents[2])
BOUND_S = 10.0
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


def _pids(out: Path, nproc: int) -> list[int]:
    """Pids of every rank and of each rank's child, once all ranks have written them."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        files = [out / f"rank{r}.json" for r in range(nproc)]
        if all(f.exists() for f in files):
            info = [json.loads(f.read_text()) for f in files]
            return [p for i in info for p in (i["pid"], i["child"])]
        time.sleep(0.05)
    raise AssertionError(f"the ranks did not start within 60 s: {sorted(os.listdir(out))}")


def _assert_gone(pids: list[int], bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} survived the launch by {bound_s} s"


def _spec(out: Path, action: str, nproc: int = 3, **kw) -> LaunchSpec:
    return LaunchSpec(
        cmd=[sys.executable, RANKS, "rank", str(out), action], nproc=nproc, kill_grace_s=1.0, **kw
    )


def test_rank_exit_code_names_rank_and_stops_the_others(tmp_path):
    result = run(_spec(tmp_path, "exit3@1"))
    assert not result.ok and result.first_failure == 1
    assert result.ranks[1].returncode == 3 and not result.ranks[1].killed
    assert result.ranks[0].killed and result.ranks[2].killed
    assert result.elapsed_s < BOUND_S
    with pytest.raises(LaunchError, match=r"rank 1 exited with 3; the other ranks were stopped"):
        result.check()
    _assert_gone(_pids(tmp_path, 3), bound_s=1.0)


def test_rank_killed_by_signal_names_the_signal(tmp_path):
    with pytest.raises(LaunchError, match="rank 2 was killed by SIGKILL"):
        run(_spec(tmp_path, "sigkill@2")).check()
    _assert_gone(_pids(tmp_path, 3), bound_s=1.0)


def test_timeout_stops_everything_and_says_so(tmp_path):
    result = run(_spec(tmp_path, "sleep", nproc=2, timeout_s=2.0))
    assert result.timed_out and all(r.killed for r in result.ranks)
    assert result.elapsed_s < 2.0 + BOUND_S
    with pytest.raises(LaunchError, match=r"timed out after .* \(timeout_s=2\)"):
        result.check()
    _assert_gone(_pids(tmp_path, 2), bound_s=1.0)


def test_rank_environment_and_prefix(tmp_path):
    spec = LaunchSpec(
        cmd=[sys.executable, RANKS, "rank", str(tmp_path), "exit3@9"],
        nproc=2,
        env={"OMP_NUM_THREADS": "2", "SHARED": "s"},
        rank_env=lambda r: {"LOCAL_RANK": str(r % 1), "OWN": f"o{r}"},
        prefix=lambda r: ["env", f"PREFIXED={r}"],
        timeout_s=1.5,
    )
    run(spec)  # the ranks sleep: stopped by the timeout
    envs = [json.loads((tmp_path / f"rank{r}.json").read_text())["env"] for r in range(2)]
    port = envs[0]["MASTER_PORT"]
    for r, env in enumerate(envs):
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(r), "2", "2")
        assert (env["LOCAL_RANK"], env["OWN"], env["PREFIXED"]) == ("0", f"o{r}", str(r))
        assert (env["OMP_NUM_THREADS"], env["SHARED"]) == ("2", "s")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == port != "0"
        assert env["MEGATRON_CHARM_INIT_METHOD"] == "env://"


def _start_launcher(out: Path, nproc: int = 2, timeout_s: float = 60.0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, RANKS, "launcher", str(out), str(nproc), str(timeout_s)], env=env
    )


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
    with open(os.path.join(out, f"fn{info.rank}"), "w") as f:
        json.dump([info.rank, info.world_size, info.local_rank, info.init_method], f)
    if info.rank == fail_rank:
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
