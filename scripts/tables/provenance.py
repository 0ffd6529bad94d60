"""Where a figure comes from: every results file says which commit and date it was measured at (`commit`, `dirty`,
`date`: bench/common.py's `provenance`), and every generated block ends with that line; a results file without them
stops the generator (ProvenanceError), so no figure reaches the manual without the code it describes. Also the
number formats every table shares."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "bench" / "results"
RESNET = ROOT / "docs" / "resnet_accuracy.json"


class ProvenanceError(ValueError):
    """A results file that does not say which commit and date its figures were measured at."""


def shown(path: Path) -> str:
    """How a page names a results file (`bench/results/NAME.json` wherever RESULTS points)."""
    return f"bench/results/{path.name}" if path.parent == RESULTS else str(path.relative_to(ROOT))


def check_provenance(path: Path, d: dict[str, Any]) -> None:
    where = shown(path)
    commit, date, dirty = d.get("commit"), d.get("date"), d.get("dirty")
    if not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit)) or not isinstance(date, str) \
            or not re.match(r"\d{4}-\d\d-\d\d", date):
        raise ProvenanceError(
            f"{where} does not say which commit and date it was measured at (`commit`: the full sha, `date`: UTC "
            f"ISO 8601, `dirty`: true/false; got commit={commit!r}, date={date!r}): re-measure it with its script, "
            "which writes them (bench/common.py: provenance), or recover them from `git log -- FILE` with a "
            "`commit_note` saying so")
    if not isinstance(dirty, bool) and not d.get("commit_note"):
        raise ProvenanceError(f"{where}: `dirty` is {dirty!r}; give true/false, or a `commit_note` saying why it is "
                              "not known")


def load_path(path: Path) -> dict[str, Any]:
    d = json.loads(path.read_text())
    check_provenance(path, d)
    return d


def load(name: str) -> dict[str, Any]:
    return load_path(RESULTS / f"{name}.json")


def check_all() -> None:
    """Every results file, quoted in a page or not, carries its commit and date."""
    for path in [*sorted(RESULTS.glob("*.json")), RESNET]:
        load_path(path)


def measured(*names: str, paths: tuple[Path, ...] = ()) -> str:
    """'Measured at commit X on DATE' for the results files a block quotes; files measured at the same commit
    share one clause."""
    files = [*(RESULTS / f"{n}.json" for n in names), *paths]
    groups: dict[tuple[str, Any, str], list[str]] = {}
    for path in files:
        d = load_path(path)
        groups.setdefault((d["commit"], d["dirty"], d["date"][:10]), []).append(f"`{shown(path)}`")
    clauses = []
    for (commit, dirty, day), where in groups.items():
        if dirty is None:  # recovered from git log afterwards
            clauses.append(f"at or before commit `{commit[:7]}`, on or before {day} ({', '.join(where)}: recovered "
                           "from `git log`, not recorded when measured)")
        else:
            clauses.append(f"at commit `{commit[:7]}`{' with uncommitted changes' if dirty else ''} on {day} "
                           f"({', '.join(where)})")
    caveats: dict[str, list[str]] = {}
    for path in files:
        if caveat := load_path(path).get("caveat"):
            caveats.setdefault(caveat, []).append(f"`{shown(path)}`")
    return " ".join(["Measured " + "; ".join(clauses) + ".",
                     *(f"{', '.join(where)} {'was' if len(where) == 1 else 'were'} {caveat}."
                       for caveat, where in caveats.items())])


def measured_at(d: dict[str, Any], where: str) -> str:
    """'Measured at commit X on DATE' for a section of a results file that records its own provenance."""
    return (f"Measured at commit `{d['commit'][:7]}`{' with uncommitted changes' if d['dirty'] else ''} on "
            f"{d['date'][:10]} (`{where}`).")


def ms(s: float) -> str:
    return f"{s * 1000:.1f} ms"


def sec(s: float | None, digits: int = 3) -> str:
    return "none recovered" if s is None else f"{s:.{digits}f} s"  # None: a baseline that never came back


def span(values: list[float], fmt: str = "{:.0f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"
