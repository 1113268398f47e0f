#!/usr/bin/env python3
"""Table of a sweep run with every peer (``sweep.py --methods peers``): per point, each method's
forward+backward median, the fastest method other than charm (or ``--method``), and its ratio
over that one.

    python scripts/bench/peers_table.py docs/results/sweep-peers [--md FILE] [--method a2a+charm]
"""

from __future__ import annotations

import argparse
import glob
import json
import os

ORDER = "charm,ring,ring-flash,ring-flash-llama3,usp,all_gather,a2a,a2a+p2p,a2a+charm,tasp".split(
    ","
)


def rows(folder: str) -> list[tuple[str, dict]]:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            out.append((os.path.splitext(os.path.basename(path))[0], json.load(f)))
    return out


def table(results: list[tuple[str, dict]], focus: str = "charm") -> str:
    """The markdown table; ``focus``: the method compared with the fastest of the others."""
    present = [m for m in ORDER if any(m in r["methods"] for _, r in results)]
    head = ["point", "CCR fwd+bwd", *(f"{m} ms" for m in present)]
    head += ["fastest peer fwd / fwd+bwd", f"{focus} over it fwd / fwd+bwd"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results:
        m = r["methods"]

        def med(method: str, mode: str, m: dict = m) -> float:
            return m[method][mode]["median"]

        cells = [name, f"{r['ccr']['fwdbwd']:.2f}"]
        cells += [f"{med(x, 'fwdbwd') * 1e3:.0f}" if x in m else "-" for x in present]
        peers = [x for x in m if x != focus]
        best = {
            mode: min(peers, key=lambda x, mode=mode: med(x, mode)) for mode in ("fwd", "fwdbwd")
        }
        cells.append(f"{best['fwd']} / {best['fwdbwd']}")
        ratio = [med(best[mode], mode) / med(focus, mode) for mode in ("fwd", "fwdbwd")]
        cells.append(f"{ratio[0]:.2f}x / {ratio[1]:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--md", help="write the table here as well")
    ap.add_argument("--method", default="charm", help="the method to compare with the others")
    args = ap.parse_args()
    text = table(rows(args.folder), args.method)
    print(text, end="")
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
