"""A launcher process for the launcher's signal tests (run as a script, not imported by pytest):
``ranks.py DIR NPROC TIMEOUT_S`` runs ``rank.sh`` ranks that wait until a signal comes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_charm.launch import LaunchSpec, run

RANK_SH = str(Path(__file__).with_name("rank.sh"))


def main() -> None:
    out, nproc, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    spec = LaunchSpec(
        cmd=["sh", RANK_SH, out, "wait", "-1"], nproc=nproc, timeout_s=timeout_s, kill_grace_s=1.0
    )
    with open(os.path.join(out, "launcher.pid"), "w") as f:
        f.write(str(os.getpid()))
    try:
        result = run(spec)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
