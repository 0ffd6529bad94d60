"""The README stays true: its config reference is the schema's, field for field."""

from __future__ import annotations

from scripts.config_reference import markdown
from tests.conftest import ROOT


def test_readme_config_reference_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- config-reference:start")
    block = readme[readme.index("\n", start) + 1: readme.index("<!-- config-reference:end")].strip()
    assert block == markdown(), "README config reference is stale: regenerate it with scripts/config_reference.py"
