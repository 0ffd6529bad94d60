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


# A measured-looking figure: a number (or a range of two) followed by a unit of time, size, rate, ratio or share.
NUM = r"\d(?:[\d,.]*\d)?"
FIGURE = re.compile(
    rf"(?<![\w.]){NUM}(?:\s?(?:–|-|to)\s?{NUM})?\s?"
    r"(?:(?:ms|µs|us|ns|s|sec|seconds|min|minutes|hours|MB/s|MiB/s|GB/s|MB|GB|kB|KB|MiB|GiB|KiB)\b|×|x\b|%)")
# What such a figure may be and still not be a measurement, each with why. Anything else outside a generated block
# is a measurement that no results file backs: generate it (scripts/tables/) or say what the mechanism does.
NOT_MEASURED = [
    (re.compile(r"^(?:1|4|16|32|64|128|256) (?:KiB|MiB)$"), "a size the code sets (chunk, cap, threshold)"),
    (re.compile(r"^\d+ ×$"), "a multiple in a formula (`2 × cluster.dead_after`, `4 × model + 16 MiB`)"),
    (re.compile(r"^\d+s$"), "s is the optimizer-state size in the memory accounts (2s, 3s), not seconds"),
    (re.compile(r"^(?:2|4|16|32)×$"), "ratios fixed by the format or the code: 32 bits to 1, 2 copies, rank 8 vs 2, "
                                      "the 16× back-off cap"),
]
# Constants written with a unit: defaults, timeouts and intervals the code sets, by page.
CONSTANTS = {
    "docs/concepts/faults.md": ["60 s", "20 s", "180 s", "2 s"],  # restart-health, spare and re-ask defaults
    "docs/contributing.md": ["300 s"],  # pytest-timeout
    "docs/benchmarks/small.md": ["5 s", "3 s", "2 s", "20 ms", "0.1 s", "1.5×", "1.0×", "1 MiB"],  # goals, timeouts
    "docs/guides/compression.md": ["10 %"],  # the share of warm-up steps the recipe sends dense
    "docs/guides/recipes.md": ["10 %"],
    "docs/benchmarks/compression.md": ["1 %"],  # topk's share of coordinates, a setting
    "docs/security.md": ["64 MB", "100 MB", "16.4 MiB", "21 MB"],  # Docker's /dev/shm default; a test's bound; the
    # cap's formula worked for the digits model; tests/test_lending.py's model
    "docs/guides/scaling-out.md": ["260 kB"],  # tests/test_shards.py's slice, under its 64 KiB cap
    "docs/design/memory.md": ["0.5 s"],  # snapshots/send.py's PROTECT_PATIENCE_S
    "docs/memory_accounting.md": ["453 MB"],  # the case's model size (an input of the draft, not a result)
    "docs/concepts/step.md": ["64 MB"],
    "docs/design/downlink.md": ["1 %"],  # topk's share of coordinates, a setting
}


def unbacked_figures(path) -> list[str]:
    """Measured-looking figures in the page's prose: outside generated blocks and code fences."""
    text = path.read_text()
    for name in readme_tables.TABLES:
        if (bounds := readme_tables.block_bounds(text, name)) is not None:
            text = text[:bounds[0]] + text[bounds[1]:]
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    allowed = CONSTANTS.get(readme_tables.named(path), [])
    return [f for f in (m.group(0) for m in FIGURE.finditer(text))
            if f not in allowed and not any(p.match(f) for p, _ in NOT_MEASURED)]


def test_no_measured_figure_outside_a_generated_block() -> None:
    """Every figure in the README or the manual comes from a results file: a measured one in prose is retyped,
    and goes stale the day the code it describes changes."""
    found = {readme_tables.named(p): f for p in readme_tables.pages() if (f := unbacked_figures(p))}
    assert not found, ("measured figures outside a generated block (generate them with scripts/readme_tables.py "
                       f"from bench/results, or describe the mechanism instead): {found}")


def test_the_constants_allowed_are_still_there() -> None:
    """An allowance whose figure left its page goes too, so the list never lets a new measurement through."""
    for name, figures in CONSTANTS.items():
        text = (ROOT / name).read_text()
        for figure in figures:
            assert figure in text, f"{name} no longer says {figure!r}: drop it from CONSTANTS"
