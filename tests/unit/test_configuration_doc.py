"""docs/configuration.md holds the settings table as the code declares it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdchat.core import settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "python -m pdchat.core.settings --write docs/configuration.md"


def test_the_committed_table_is_the_generated_one():
    committed = DOC.read_text()
    assert committed == settings.with_table(committed), f"docs/configuration.md is out of date: run {REGENERATE}"


def test_every_setting_has_its_row():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [setting.name for setting in settings.SETTINGS]


def test_check_fails_on_a_stale_table_and_write_regenerates_it(tmp_path, capsys):
    doc = tmp_path / "configuration.md"
    doc.write_text(f"# Intro\n\n{settings.BEGIN_MARKER}\n| stale |\n{settings.END_MARKER}\n\nOutro\n")
    assert settings.main(["--check", str(doc)]) == 1
    assert f"run python -m pdchat.core.settings --write {doc}" in capsys.readouterr().err
    assert settings.main(["--write", str(doc)]) == 0
    assert settings.main(["--check", str(doc)]) == 0
    regenerated = f"# Intro\n\n{settings.BEGIN_MARKER}\n{settings.markdown()}{settings.END_MARKER}\n\nOutro\n"
    assert doc.read_text() == regenerated


def test_a_document_without_the_markers_is_refused(tmp_path):
    doc = tmp_path / "configuration.md"
    doc.write_text("# No table here\n")
    with pytest.raises(SystemExit):
        settings.main(["--check", str(doc)])
