"""The README stays true: its config reference is the schema's, field for field, every figure table is
generated from bench/results/*.json, and every results file says which commit and date it was measured at."""

from __future__ import annotations

import json
import re

import pytest

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


def copy_results(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    for f in (ROOT / "bench" / "results").glob("*.json"):
        (results / f.name).write_text(f.read_text())
    monkeypatch.setattr(readme_tables, "RESULTS", results)
    return results


def test_every_results_file_says_its_commit_and_date() -> None:
    readme_tables.check_all()  # raises ProvenanceError naming the file
    for f in [*(ROOT / "bench" / "results").glob("*.json"), readme_tables.RESNET]:
        d = json.loads(f.read_text())
        assert re.fullmatch(r"[0-9a-f]{40}", d["commit"]), f
        assert isinstance(d["dirty"], bool) or d["commit_note"], f


@pytest.mark.parametrize("field", ["commit", "date"])
def test_a_results_file_without_commit_or_date_stops_the_generator(tmp_path, monkeypatch, capsys, field) -> None:
    """Even a file no table quotes (curve.json): the generator refuses, loudly, rather than print its figures."""
    results = copy_results(tmp_path, monkeypatch)
    data = json.loads((results / "curve.json").read_text())
    del data[field]
    (results / "curve.json").write_text(json.dumps(data))
    with pytest.raises(readme_tables.ProvenanceError, match="bench/results/curve.json"):
        readme_tables.regenerate((ROOT / "README.md").read_text())
    monkeypatch.setattr(readme_tables, "README", tmp_path / "README.md")
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text())
    assert readme_tables.main([]) == 2
    assert "curve.json does not say which commit and date" in capsys.readouterr().err


def test_every_generated_table_says_the_commit_it_was_measured_at() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = readme_tables.blocks(readme)
    for name in ("bench-table", "compression-table", "scaling-table", "small-table", "cluster-table",
                 "resnet-accuracy"):
        assert re.search(r"Measured (at|at or before) commit `[0-9a-f]{7}`", blocks[name]), name


def test_a_measured_line_names_commit_date_and_uncommitted_changes(tmp_path, monkeypatch) -> None:
    results = copy_results(tmp_path, monkeypatch)
    data = json.loads((results / "scaling.json").read_text())
    for k in ("commit_note", "caveat"):
        data.pop(k, None)
    data.update(commit="ab" * 20, dirty=True, date="2027-01-02T03:04:05Z")
    (results / "scaling.json").write_text(json.dumps(data))
    line = readme_tables.measured("scaling")
    assert line == "Measured at commit `abababa` with uncommitted changes on 2027-01-02 (`bench/results/scaling.json`)."
    assert line in readme_tables.scaling()
