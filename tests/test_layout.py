"""The layout stays readable (issue 45): every package is installed, each says in its `__init__` what its modules
do, no module under `services/` or `shared/` grows past 350 lines and no folder past 14 modules flat.

A split comes with the growth, not a turn later: these fail the commit that crosses a bound, naming the file."""

from __future__ import annotations

import ast

import tomllib

from tests.conftest import ROOT

CODE = ("cmemi", "shared", "services")
MAX_LINES = 350
MAX_FLAT = 14
# file -> why it may be longer (keep this short; each entry is a promise to split when it is next changed)
LONG_OK: dict[str, str] = {}


def packages() -> list:
    return sorted(p.parent for top in CODE for p in (ROOT / top).rglob("__init__.py") if ".venv" not in p.parts)


def dotted(pkg_dir) -> str:
    rel = pkg_dir.relative_to(ROOT).parts
    return ".".join(rel if rel[0] == "cmemi" else ("cmemi", *rel))


def test_every_package_in_the_tree_is_installed_by_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    missing = sorted(dotted(p) for p in packages() if dotted(p) not in listed)
    assert not missing, f"add to pyproject.toml [tool.setuptools] packages: {missing}"


def test_every_subpackage_maps_its_modules_in_its_docstring() -> None:
    bare = []
    for p in packages():
        if p.relative_to(ROOT).parts in (("shared",), ("services",)):
            continue
        doc = ast.get_docstring(ast.parse((p / "__init__.py").read_text())) or ""
        modules = [m.stem for m in p.glob("*.py") if m.stem not in ("__init__", "__main__")]
        unnamed = [m for m in modules if m not in doc]
        if not doc or unnamed:
            bare.append(f"{p.relative_to(ROOT)} (not named: {unnamed})")
    assert not bare, f"each package's __init__.py docstring names each of its modules and its job: {bare}"


def test_no_module_of_the_services_or_the_library_is_over_350_lines() -> None:
    long = []
    for top in ("shared", "services"):
        for f in (ROOT / top).rglob("*.py"):
            rel = str(f.relative_to(ROOT))
            n = len(f.read_text().splitlines())
            if n > MAX_LINES and rel not in LONG_OK:
                long.append(f"{rel} ({n} lines)")
    assert not long, f"split by job (one job per module): {long}"


def test_no_folder_holds_more_than_14_modules_flat() -> None:
    crowded = []
    for p in packages():
        n = sum(1 for m in p.glob("*.py") if m.stem not in ("__init__", "__main__"))
        if n > MAX_FLAT:
            crowded.append(f"{p.relative_to(ROOT)} ({n})")
    assert not crowded, f"group by concern into subpackages: {crowded}"
