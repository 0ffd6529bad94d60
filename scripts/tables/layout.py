"""The manual's map of the tree (docs/design/layout.md): one table per package, made from the package itself.

Each package's `__init__.py` names its modules and their jobs in its docstring (tests/test_layout.py makes sure it
names every one); this turns that list into the table the map shows, with each module's line count read from the
file. So the map has one source, the code, and cannot drift from it: a module added, split or renamed changes the
table at the next `python scripts/readme_tables.py`, and tests/test_readme.py fails until it is run.

Two docstring forms are read: ``- `name.py`: its job.`` and ``- name   its job`` (a name and at least two spaces).
A sub-package (``- `compute/`: ...``) is shown with the lines of all its modules together.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

from scripts.tables.provenance import ROOT

SKIP = {"cmemi.examples"}  # examples/ is the user's side of the plug-in API, not a part of the tree's map
_TICKED = re.compile(r"^- `([\w./]+)`:?\s+(.*)$")
_PLAIN = re.compile(r"^- ([\w./]+)\s{2,}(.*)$")


class LayoutError(ValueError):
    """A package's docstring names a module that is not there."""


def packages() -> dict[str, Path]:
    """Every installed package (pyproject.toml's list) and its folder, but SKIP."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = sorted(tool["package-dir"].items(), key=lambda kv: -len(kv[0]))
    out = {}
    for name in tool["packages"]:
        if name in SKIP:
            continue
        top, folder = next((k, v) for k, v in roots if name == k or name.startswith(k + "."))
        out[name] = ROOT / folder / Path(*name[len(top):].lstrip(".").split(".")) if name != top else ROOT / folder
    return out


def block_names() -> list[str]:
    return [f"layout:{name}" for name in packages()]


def entries(folder: Path) -> list[tuple[str, str]]:
    """(module or sub-package, its job) as the package's docstring lists them, in its order."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    out: list[tuple[str, str]] = []
    for line in doc.splitlines():
        m = _TICKED.match(line) or _PLAIN.match(line)
        if m:
            out.append((m[1], m[2].strip()))
        elif out and line.startswith("  ") and line.strip():  # a job that runs on to the next line
            out[-1] = (out[-1][0], f"{out[-1][1]} {line.strip()}")
    return out


def lines_of(path: Path) -> int:
    files = [f for f in sorted(path.rglob("*")) if f.is_file() and "__pycache__" not in f.parts] if path.is_dir() \
        else [path]
    return sum(len(f.read_text().splitlines()) for f in files)


def module_table(package: str) -> str:
    folder = packages()[package]
    rows = ["| module | lines | its job |", "|---|--:|---|"]
    for name, job in entries(folder):
        path = folder / name.rstrip("/") if name.endswith("/") else folder / (name if name.endswith(".py") else
                                                                               f"{name}.py")
        shown = name if name.endswith(("/", ".py")) else f"{name}.py"
        if not path.exists():
            raise LayoutError(f"{folder.relative_to(ROOT)}/__init__.py names {name!r}, which is not there: "
                              "fix the docstring's list")
        cell = job.replace("|", "\\|")
        rows.append(f"| `{shown}` | {lines_of(path)} | {cell} |")
    return "\n".join(rows)


def over_300() -> str:
    """The modules past the ~300 lines a module should stay under: each is the next to split when it is changed."""
    found = []
    for folder in ("cmemi", "services", "shared"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            if (n := lines_of(f)) > 300:
                found.append((n, f.relative_to(ROOT)))
    if not found:
        return "No module is over 300 lines."
    shown = ", ".join(f"`{path}` ({n})" for n, path in sorted(found, reverse=True))
    return f"Over 300 lines, each the next to split when it is changed: {shown}."
