"""The plan listings and byte tables in the docs are what the planner prints today."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_charm.plan import doc_sync

DOCS = Path(__file__).resolve().parents[2] / "docs"
GENERATED = [p for p in sorted(DOCS.rglob("*.md")) if "<!-- render:" in p.read_text()]


def test_design_doc_has_generated_listings():
    assert DOCS / "design.md" in GENERATED
    regions = list(doc_sync.REGION.finditer((DOCS / "design.md").read_text()))
    assert len(regions) >= 8


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.name)
def test_listings_match_the_planner(path: Path):
    stale = doc_sync.stale_regions(path)
    assert not stale, (
        f"{path.name} has listings the planner no longer prints: {stale}; regenerate with "
        f"python -m megatron_charm.plan.doc_sync docs/{path.name}"
    )


def test_a_stale_listing_is_detected(tmp_path: Path):
    good = doc_sync.synced(
        "<!-- render: --method ring --nodes 1 --ranks-per-node 2 --rank 0 -->\n<!-- /render -->\n"
    )
    assert "compute q0.full x kv0.full causal" in good
    path = tmp_path / "doc.md"
    path.write_text(good)
    assert doc_sync.stale_regions(path) == []
    path.write_text(good.replace("kv0.full causal", "kv1.full causal"))
    assert doc_sync.stale_regions(path) == ["--method ring --nodes 1 --ranks-per-node 2 --rank 0"]
    assert doc_sync.main(["--check", str(path)]) == 1
    assert doc_sync.main([str(path)]) == 0
    assert path.read_text() == good
