"""Rank programs and a launcher process for the launcher's tests (run as scripts, not imported
by pytest). Each rank records its pid and its child's pid in a folder, then does what the test
asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from megatron_charm.launch import LaunchSpec, run


def rank() -> None:
    """``ranks.py rank DIR ACTION``: ACTION is ``sleep``, ``exit3@R`` or ``sigkill@R``."""
    out, action = sys.argv[2], sys.argv[3]
    me = int(os.environ["RANK"])
    # A child in the rank's process group: stopping a rank must reach it too.
    child = subprocess.Popen(["sleep", "60"])
    with open(os.path.join(out, f"rank{me}.json.tmp"), "w") as f:
        json.dump({"pid": os.getpid(), "child": child.pid, "env": dict(os.environ)}, f)
    os.replace(os.path.join(out, f"rank{me}.json.tmp"), os.path.join(out, f"rank{me}.json"))
    what, _, who = action.partition("@")
    if who and int(who) == me:
        time.sleep(0.3)
        if what == "exit3":
            sys.exit(3)
        if what == "sigkill":
            os.kill(os.getpid(), 9)
    time.sleep(60)


def launcher() -> None:
    """``ranks.py launcher DIR NPROC TIMEOUT_S``: run sleeping ranks until a signal comes."""
    out, nproc, timeout_s = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    spec = LaunchSpec(
        cmd=[sys.executable, __file__, "rank", out, "sleep"],
        nproc=nproc,
        timeout_s=timeout_s,
        kill_grace_s=1.0,
    )
    with open(os.path.join(out, "launcher.pid"), "w") as f:
        f.write(str(os.getpid()))
    try:
        result = run(spec)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    {"rank": rank, "launcher": launcher}[sys.argv[1]]()
