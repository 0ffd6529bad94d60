"""Every repository path the README and the manual name in backticks exists, so a move or a rename cannot leave the
docs pointing at a file that is gone without a test saying which page and which path (issue 45: after the tree was
split by job, a dozen such paths had gone stale silently: `shared/shards.py`, `leader/dataprint.py`, `codecs.py`).

A path is a backticked token that starts with one of the repository's top-level folders (`shared/wire/messages.py`,
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
    text = ("see `shared/wire/messages.py:12-30`, `python scripts/typecheck.py -p x`, `bench/results/*.json`, "
            "`cmemi.shared.wire`, `RUN_DIR/logs/`, and shared/not_in_a_span.py")
    assert named_paths(text) == ["shared/wire/messages.py", "scripts/typecheck.py"]


def test_every_path_the_docs_name_exists() -> None:
    stale = [f"{page.relative_to(ROOT)}: {path}" for page in pages() for path in named_paths(page.read_text())
             if not (ROOT / path).exists()]
    assert not stale, f"these pages name files that are not in the tree (moved or renamed? fix the page): {stale}"
