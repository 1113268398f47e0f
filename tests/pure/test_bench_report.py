"""scripts/bench's one way to hand over a table: printed, and written where --md asks."""

from __future__ import annotations

import pytest

from megatron_charm.bench.report import emit
from tests.bench_scripts import SCRIPTS, load_bench_script


def test_emit_prints_and_writes_one_trailing_newline(tmp_path, capsys) -> None:
    out = tmp_path / "table.md"
    emit("| a |\n|---|\n", out)
    assert capsys.readouterr().out == "| a |\n|---|\n\n"
    assert out.read_text() == "| a |\n|---|\n"
    emit("no newline", str(out))
    assert out.read_text() == "no newline\n"
    emit("printed only", None)
    assert capsys.readouterr().out.endswith("printed only\n")


@pytest.mark.parametrize(
    "name", sorted(p.stem for p in SCRIPTS.glob("*.py") if "args.md" in p.read_text())
)
def test_every_script_with_md_hands_it_to_emit(name: str) -> None:
    # the scripts that write their table to --md do it through emit (peers_table prints
    # without a newline and plan_scale appends row by row: they keep their own)
    text = (SCRIPTS / f"{name}.py").read_text()
    if name in ("peers_table", "plan_scale"):
        assert "emit(" not in text
        return
    assert "emit(" in text and 'open(args.md, "w")' not in text
    load_bench_script(name)  # imports cleanly
