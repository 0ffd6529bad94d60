"""The README stays true: its config reference is the schema's, field for field, and every figure table is
generated from bench/results/*.json."""

from __future__ import annotations

import json

from scripts import readme_tables
from scripts.config_reference import markdown
from tests.conftest import ROOT


def test_readme_config_reference_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- config-reference:start")
    block = readme[readme.index("\n", start) + 1: readme.index("<!-- config-reference:end")].strip()
    assert block == markdown(), "README config reference is stale: regenerate it with scripts/config_reference.py"


def test_readme_figure_tables_match_bench_results() -> None:
    readme = (ROOT / "README.md").read_text()
    for name, block in readme_tables.blocks(readme).items():
        assert block == readme_tables.TABLES[name]().strip(), (
            f"README {name} differs from bench/results/*.json: regenerate it with scripts/readme_tables.py")


def test_readme_tables_fail_when_a_result_changes(tmp_path, monkeypatch) -> None:
    """The check can fail: one changed figure in a results file makes the README stale."""
    results = tmp_path / "results"
    results.mkdir()
    for f in (ROOT / "bench" / "results").glob("*.json"):
        (results / f.name).write_text(f.read_text())
    data = json.loads((results / "compression.json").read_text())
    data["examples"]["digits"][0]["bytes_sent_per_step"] += 1000
    (results / "compression.json").write_text(json.dumps(data))
    monkeypatch.setattr(readme_tables, "RESULTS", results)
    blocks = readme_tables.blocks((ROOT / "README.md").read_text())
    assert blocks["compression-table"] != readme_tables.compression().strip()
    assert blocks["bench-table"] == readme_tables.benchmark().strip()
