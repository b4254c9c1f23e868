"""Every setting a user can give is in the README's configuration table."""

from __future__ import annotations

from pathlib import Path

from services.settings import Settings

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_setting_is_in_the_readme() -> None:
    text = README.read_text()
    missing = [f"MEMSTREAM_{name.upper()}" for name in Settings.model_fields if f"MEMSTREAM_{name.upper()}" not in text]
    assert missing == []
