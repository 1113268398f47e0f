"""Check that a training run trained: its ``metrics.jsonl`` shows a finite, falling loss.

    python scripts/slurm/check_metrics.py RUN_DIR [--min-iters N] [--min-drop F]

Exit status 0 when the mean loss of the last three iterations is below ``(1 - F)`` times the mean
of the first three (default F = 0.05); 1 otherwise, with the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def check_metrics(run_dir: Path, min_iters: int = 6, min_drop: float = 0.05) -> str:
    """Return a one-line summary of a run that trained; raise ValueError naming what is wrong."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: the job wrote no metrics")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    losses = [float(r["loss"]) for r in records if "loss" in r]
    if len(losses) < min_iters:
        raise ValueError(f"{path} has {len(losses)} loss values, expected at least {min_iters}")
    if not all(math.isfinite(x) for x in losses):
        raise ValueError(f"{path} has non-finite losses: {losses}")
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    if last > (1.0 - min_drop) * first:
        raise ValueError(
            f"loss did not fall by {min_drop:.0%}: first three {first:.4f}, last three {last:.4f}"
        )
    return f"{len(losses)} iterations, loss {first:.4f} -> {last:.4f} (mean of first/last three)"


def main() -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--min-iters", type=int, default=6)
    parser.add_argument("--min-drop", type=float, default=0.05)
    args = parser.parse_args()
    try:
        print("metrics OK:", check_metrics(args.run_dir, args.min_iters, args.min_drop))
    except ValueError as exc:
        print(f"metrics check failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
