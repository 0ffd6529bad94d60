"""The manual and the README stay true: the config reference is the schema's, field for field, every figure table is
generated from bench/results/*.json, each generated block is in exactly one page, every results file says which
commit and date it was measured at, and the README stays a README (at most 250 lines)."""

from __future__ import annotations

import json
import re

import pytest

from scripts import readme_tables
from scripts.config_reference import markdown
from scripts.tables import compression, overview, provenance
from tests.conftest import ROOT


def page(name: str) -> str:
    return (ROOT / name).read_text()


def all_blocks() -> dict[str, str]:
    out: dict[str, str] = {}
    for path in readme_tables.pages():
        out.update(readme_tables.blocks(path.read_text()))
    return out


def test_config_reference_is_current() -> None:
    text = page("docs/reference/config.md")
    start = text.index("<!-- config-reference:start")
    block = text[text.index("\n", start) + 1: text.index("<!-- config-reference:end")].strip()
    assert block == markdown(), ("docs/reference/config.md is stale: regenerate it with scripts/readme_tables.py "
                                 "(the table is scripts/config_reference.py's)")


def test_figure_tables_match_bench_results() -> None:
    held = readme_tables.where()  # every block in exactly one page (MarkerError otherwise)
    assert set(held) == set(readme_tables.TABLES)
    for path in readme_tables.pages():
        for name, block in readme_tables.blocks(path.read_text()).items():
            assert block == readme_tables.TABLES[name]().strip(), (
                f"{path.relative_to(ROOT)}: {name} differs from bench/results/*.json: regenerate it with "
                "scripts/readme_tables.py")
    assert readme_tables.main(["--check"]) == 0


def test_the_readme_quotes_headline_figures_and_stays_short() -> None:
    readme = page("README.md")
    assert len(readme.splitlines()) <= 250, "README.md is for the first ten minutes: move the rest to docs/"
    assert readme_tables.where()["headlines"] == ROOT / "README.md"
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link


def test_tables_fail_when_a_result_changes(tmp_path, monkeypatch) -> None:
    """The check can fail: one changed figure in a results file makes the manual stale."""
    results = tmp_path / "results"
    results.mkdir()
    for f in (ROOT / "bench" / "results").glob("*.json"):
        (results / f.name).write_text(f.read_text())
    data = json.loads((results / "compression.json").read_text())
    data["examples"]["digits"][0]["bytes_sent_per_step"] += 1000
    (results / "compression.json").write_text(json.dumps(data))
    monkeypatch.setattr(provenance, "RESULTS", results)
    blocks = all_blocks()
    assert blocks["compression-table"] != compression.compression().strip()
    assert blocks["bench-table"] == overview.benchmark().strip()
    assert readme_tables.main(["--check"]) == 1


def test_a_block_in_two_pages_is_refused(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(readme_tables, "README", tmp_path / "README.md")
    (tmp_path / "README.md").write_text(page("README.md") + "\n<!-- scaling-table:start -->\n<!-- scaling-table:end -->\n")
    with pytest.raises(readme_tables.MarkerError, match="scaling-table"):
        readme_tables.where()
    assert readme_tables.main(["--check"]) == 2
    assert "in exactly one page" in capsys.readouterr().err


def copy_results(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    for f in (ROOT / "bench" / "results").glob("*.json"):
        (results / f.name).write_text(f.read_text())
    monkeypatch.setattr(provenance, "RESULTS", results)
    return results


def test_every_results_file_says_its_commit_and_date() -> None:
    provenance.check_all()  # raises ProvenanceError naming the file
    for f in [*(ROOT / "bench" / "results").glob("*.json"), provenance.RESNET]:
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
    with pytest.raises(provenance.ProvenanceError, match="bench/results/curve.json"):
        readme_tables.regenerate(page("docs/benchmarks/index.md"))
    monkeypatch.setattr(readme_tables, "README", tmp_path / "README.md")
    (tmp_path / "README.md").write_text(page("README.md"))
    assert readme_tables.main([]) == 2
    assert "curve.json does not say which commit and date" in capsys.readouterr().err


def test_every_generated_table_says_the_commit_it_was_measured_at() -> None:
    blocks = all_blocks()
    for name in ("bench-table", "compression-table", "scaling-table", "small-table", "cluster-table",
                 "resnet-accuracy", "headlines"):
        assert re.search(r"Measured (at|at or before) commit `[0-9a-f]{7}`", blocks[name]), name


def test_a_measured_line_names_commit_date_and_uncommitted_changes(tmp_path, monkeypatch) -> None:
    results = copy_results(tmp_path, monkeypatch)
    data = json.loads((results / "scaling.json").read_text())
    for k in ("commit_note", "caveat"):
        data.pop(k, None)
    data.update(commit="ab" * 20, dirty=True, date="2027-01-02T03:04:05Z")
    (results / "scaling.json").write_text(json.dumps(data))
    line = provenance.measured("scaling")
    assert line == "Measured at commit `abababa` with uncommitted changes on 2027-01-02 (`bench/results/scaling.json`)."
    assert line in overview.scaling()
