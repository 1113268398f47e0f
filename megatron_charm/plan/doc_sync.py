"""Keep the plan listings and byte tables in the docs equal to what the planner prints.

A generated region in a Markdown file is::

    <!-- render: --method ring --nodes 1 --ranks-per-node 8 --cp-rank 2 -->
    ...whatever ``python -m megatron_charm.plan.render <args>`` prints...
    <!-- /render -->

Program listings are put in a code fence that starts with the command; tables (``--bytes``,
``--cross-bytes``) go in as Markdown. ``--check`` exits 1 when a file differs from what the
planner prints now, which ``tests/pure/test_doc_listings.py`` runs, so a planner change that does
not regenerate the docs fails the suite::

    python -m megatron_charm.plan.doc_sync docs/design.md           # rewrite
    python -m megatron_charm.plan.doc_sync --check docs/design.md   # compare only
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

from megatron_charm.plan import render

REGION = re.compile(r"<!-- render: (?P<args>[^>]*?) -->\n(?P<body>.*?)<!-- /render -->", re.S)
TABLE_FLAGS = ("--bytes", "--cross-bytes")


def rendered(args: str) -> str:
    """The body of a region: the output of ``render`` with ``args``, fenced unless a table."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        render.main(shlex.split(args))
    text = out.getvalue().rstrip("\n")
    if any(flag in shlex.split(args) for flag in TABLE_FLAGS):
        return text + "\n"
    return f"```\n$ python -m megatron_charm.plan.render {args}\n{text}\n```\n"


def synced(text: str) -> str:
    """``text`` with every generated region regenerated."""
    return REGION.sub(
        lambda m: f"<!-- render: {m['args']} -->\n{rendered(m['args'])}<!-- /render -->", text
    )


def stale_regions(path: Path) -> list[str]:
    """The ``args`` of every region of ``path`` whose body differs from the planner's output."""
    return [
        m["args"] for m in REGION.finditer(path.read_text()) if m["body"] != rendered(m["args"])
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = ap.parse_args(argv)
    status = 0
    for path in args.files:
        if args.check:
            for stale in stale_regions(path):
                print(
                    f"{path}: stale listing 'render {stale}'; run "
                    f"python -m megatron_charm.plan.doc_sync {path}",
                    file=sys.stderr,
                )
                status = 1
        else:
            path.write_text(synced(path.read_text()))
    return status


if __name__ == "__main__":
    sys.exit(main())
