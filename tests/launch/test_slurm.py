"""The Slurm launchers under a real Slurm (opt-in: ``MEGATRON_CHARM_SLURM_TEST=1``, root, Debian).

``scripts/slurm/run_slurm_test.sh`` installs slurm-wlm and munge when missing, starts private
daemons, submits the smoke jobs and the 4-rank CPU training job with sbatch (both launch modes)
and checks that the loss fell. It takes a few minutes, so it is not part of the default run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "run_slurm_test.sh"


@pytest.mark.slurm
def test_sbatch_launcher_under_real_slurm() -> None:
    if os.environ.get("MEGATRON_CHARM_SLURM_TEST") != "1":
        pytest.skip(
            "set MEGATRON_CHARM_SLURM_TEST=1 to run the real-Slurm test (root, apt, 2-3 min)"
        )
    if os.geteuid() != 0:
        pytest.skip("the real-Slurm test installs packages and starts daemons: run it as root")
    if shutil.which("apt-get") is None and shutil.which("sbatch") is None:
        pytest.skip("needs Debian's apt-get (to install slurm-wlm) or an installed Slurm")
    timeout = int(os.environ.get("MEGATRON_CHARM_SLURM_TIMEOUT", "1800"))
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "SLURM TEST PASSED" in proc.stdout
    assert "smoke jobs passed" in proc.stdout
    assert proc.stdout.count("metrics OK:") >= 1, proc.stdout[-3000:]
