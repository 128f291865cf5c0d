"""The configuration reference is generated from the code and cannot drift."""

from pathlib import Path

from dynarl.config_doc import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_reference_matches_the_config_tree() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: run `python -m dynarl.config_doc > docs/configuration.md`"
    )


def test_every_field_is_documented() -> None:
    undocumented = [line for line in render().splitlines() if line.endswith("|  |")]
    assert not undocumented, undocumented
