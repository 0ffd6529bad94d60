"""Every repository path the README and the manual name in backticks exists, and every link of the README resolves,
so a move or a rename cannot leave the docs pointing at a file that is gone without a test saying which page and
which path (issue 45: after the tree was split by job, a dozen such paths had gone stale silently: `shared/shards.py`,
`leader/dataprint.py`, `codecs.py`).

A path is a backticked token that starts with one of the repository's top-level folders (`shared/wire/protocol.py`,
`services/worker/links/intake.py:121`, `tests/helpers/`); a line number or a `.name` after it is not part of it, and a
pattern (`bench/results/*.json`, `<run>`) is not a path."""

from __future__ import annotations

import re

from tests.conftest import ROOT

TOPS = ("bench", "cmemi", "deploy", "docker", "docs", "examples", "scripts", "services", "shared", "tests")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOPS) + r")/[\w./-]*)")


def pages() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def named_paths(text: str) -> list[str]:
    """The repository paths named in a page's code spans, as they would be opened."""
    out = []
    for span in CODE_SPAN.findall(text):
        if any(c in span for c in "*<>{}$"):
            continue
        for m in PATH.finditer(span):
            out.append(m.group(1).rstrip("."))
    return out


def test_the_path_finder_reads_spans_as_meant() -> None:
    text = ("see `shared/wire/protocol.py:12-30`, `python scripts/typecheck.py -p x`, `bench/results/*.json`, "
            "`cmemi.shared.wire`, `RUN_DIR/logs/`, and shared/not_in_a_span.py")
    assert named_paths(text) == ["shared/wire/protocol.py", "scripts/typecheck.py"]


def test_every_path_the_docs_name_exists() -> None:
    stale = [f"{page.relative_to(ROOT)}: {path}" for page in pages() for path in named_paths(page.read_text())
             if not (ROOT / path).exists()]
    assert not stale, f"these pages name files that are not in the tree (moved or renamed? fix the page): {stale}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as the manual's Markdown `toc` extension makes it: lower case, punctuation dropped,
    spaces to hyphens ("Start-up: the zygote" -> start-up-the-zygote)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def anchors(path) -> set[str]:
    return {slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def test_the_slug_is_the_manuals() -> None:
    assert slug("Start-up: the zygote") == "start-up-the-zygote"
    assert slug("GPU machines") == "gpu-machines"


def test_every_link_of_the_readme_resolves() -> None:
    """The README is not part of the manual, so `mkdocs build --strict` does not check its links: here, each relative
    link's file exists and its anchor is a heading of that file (the README once linked #start-up-the-zygote after
    that section had moved to docs/benchmarks/small.md)."""
    readme = ROOT / "README.md"
    broken = []
    for target in LINK.findall(readme.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        path = ROOT / file if file else readme
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(target)
    assert not broken, f"README.md links to what is not there (point each at the manual page that has it): {broken}"
