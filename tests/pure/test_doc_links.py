"""Every relative link of the README and the docs names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """``"file: link"`` for each relative Markdown link of ``files`` whose target is missing
    (web links and in-page anchors aside; a link's own anchor is not checked)."""
    out = []
    for f in files:
        for m in LINK.finditer(f.read_text()):
            target = m.group(1).split("#")[0]
            if not target or m.group(1).startswith(("http://", "https://", "mailto:")):
                continue
            if not (f.parent / target).exists():
                out.append(f"{f.relative_to(root)}: {m.group(1)}")
    return out


def test_the_docs_links_resolve():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(files) > 20
    assert broken_links(files) == []


def test_a_missing_target_is_reported(tmp_path):
    (tmp_path / "here.md").write_text("x")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](here.md#part) [web](https://x.y) [anchor](#a) [gone](gone.md)\n")
    assert broken_links([doc], tmp_path) == ["doc.md: gone.md"]
