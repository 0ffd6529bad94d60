"""The generated blocks of README.md and of the manual's pages (docs/**/*.md): figure tables from
bench/results/*.json (what `make bench` writes), the config reference from the schema, and the map of the tree
(docs/design/layout.md) from each package's docstring.

`python scripts/readme_tables.py` rewrites every block between `<!-- NAME:start ... -->` and `<!-- NAME:end -->` in
whichever page holds it; `--check` exits 1 when one differs (tests/test_readme.py runs the same comparison). Each
block is in exactly one page. A figure that is in no results file has no place in these tables; every block that
quotes one ends with the commit and date it was measured at (scripts/tables/provenance.py), and a results file without
them stops the generator, so no figure reaches the manual without the code it describes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

if not __package__:  # run as `python scripts/readme_tables.py`: the repository root makes `scripts` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.config_reference import markdown as config_reference  # noqa: E402
from scripts.tables import cluster, compression, headlines, hf, layout, local, memory, overview, resnet, small  # noqa: E402
from scripts.tables.home import home as home_table  # noqa: E402
from scripts.tables.home import home_rounds  # noqa: E402
from scripts.tables.provenance import ROOT, ProvenanceError, check_all  # noqa: E402
from scripts.tables.soak import soak as soak_table  # noqa: E402
from scripts.tables.steplog import steplog as steplog_table  # noqa: E402
from scripts.tables.steplog import steplog_cost  # noqa: E402

README = ROOT / "README.md"
DOCS = ROOT / "docs"
GENERATOR = ".venv/bin/python scripts/readme_tables.py"

TABLES: dict[str, Callable[[], str]] = {
    "headlines": headlines.headlines, "bench-table": overview.benchmark, "scaling-table": overview.scaling,
    "memory-table": memory.memory, "compression-table": compression.compression, "streaming-table": local.streaming,
    "local-steps-table": local.local_steps, "outer-codecs-table": local.outer_codecs, "home-links-table": home_table, "home-rounds-table": home_rounds, "small-table": small.small, "cluster-table": cluster.cluster,
    "cluster-notes": cluster.cluster_notes, "resnet-accuracy": resnet.resnet_accuracy,
    "hf-lm-table": hf.hf_lm, "config-reference": config_reference, "soak-table": soak_table, "steplog-table": steplog_table, "steplog-cost-table": steplog_cost,
    "layout:over-300": layout.over_300,
    **{name: partial(layout.module_table, name.partition(":")[2]) for name in layout.block_names()},
}


class MarkerError(ValueError):
    """A generated block whose markers are missing, or in more than one page."""


def named(page: Path) -> str:
    return str(page.relative_to(ROOT) if page.is_relative_to(ROOT) else page)


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def block_bounds(text: str, name: str) -> tuple[int, int] | None:
    """(start, end) of the generated content between NAME's markers, or None where the text has no such block."""
    start = text.find(f"<!-- {name}:start")
    if start < 0:
        return None
    return text.index("\n", start) + 1, text.index(f"<!-- {name}:end")


def blocks(text: str) -> dict[str, str]:
    """The generated blocks this text holds, by name."""
    out = {}
    for name in TABLES:
        if (bounds := block_bounds(text, name)) is not None:
            out[name] = text[bounds[0]:bounds[1]].strip()
    return out


def where() -> dict[str, Path]:
    """The page that holds each block: exactly one per block."""
    found: dict[str, list[Path]] = {}
    for page in pages():
        for name in blocks(page.read_text()):
            found.setdefault(name, []).append(page)
    for name in TABLES:
        held = found.get(name, [])
        if len(held) != 1:
            shown = ", ".join(named(p) for p in held) or "no page"
            raise MarkerError(f"block {name!r} is in {shown}: put `<!-- {name}:start -->` ... `<!-- {name}:end -->` "
                              "in exactly one page of README.md or docs/")
    return {name: held[0] for name, held in found.items()}


def regenerate(text: str) -> str:
    """The text with every block it holds made again from the results files."""
    check_all()
    for name, make in TABLES.items():
        if (bounds := block_bounds(text, name)) is not None:
            text = text[:bounds[0]] + make() + "\n" + text[bounds[1]:]
    return text


def main(argv: list[str]) -> int:
    try:
        check_all()
        stale = []
        for page in sorted(set(where().values())):
            text = page.read_text()
            new = regenerate(text)
            if new != text:
                stale.append(page)
                if "--check" not in argv:
                    page.write_text(new)
    except (ProvenanceError, MarkerError, layout.LayoutError) as exc:
        print(f"readme_tables: {exc}", file=sys.stderr)
        return 2
    if "--check" in argv and stale:
        print(f"{', '.join(named(p) for p in stale)}: generated blocks differ from bench/results or "
              f"the config schema: run {GENERATOR}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
