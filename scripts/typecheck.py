"""Run mypy on the package as it is installed: `python scripts/typecheck.py` checks `cmemi.shared` (strict, per
pyproject.toml's [tool.mypy]); any other arguments go to mypy instead (e.g. `-p cmemi -p cmemi.services`).

mypy cannot follow the import hook of an editable install (PEP 660), and the repository keeps `shared/`, `services/`
and `examples/` beside `cmemi/` where the install maps them under it (pyproject.toml's package-dir). So this script
lays out the package as installed, a tree of symbolic links in .mypy_cache/tree/cmemi (rebuilt on every run, so a new
module is always seen), and points mypy at it (MYPYPATH); errors name the files through those links.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"shared": "shared", "services": "services", "examples": "examples"}  # cmemi.<key> -> <value>/


def tree() -> Path:
    """The link tree: cmemi/'s own entries, and the mapped folders inside it."""
    base = ROOT / ".mypy_cache" / "tree"
    pkg = base / "cmemi"
    shutil.rmtree(base, ignore_errors=True)
    pkg.mkdir(parents=True)
    for entry in (ROOT / "cmemi").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in MAPPED.items():
        (pkg / name).symlink_to(ROOT / folder)
    return base


def main(argv: list[str]) -> int:
    env = {**os.environ, "MYPYPATH": str(tree())}
    args = argv or ["-p", "cmemi.shared"]
    config = ["--config-file", str(ROOT / "pyproject.toml")]
    return subprocess.call([sys.executable, "-m", "mypy", *config, *args], cwd=ROOT / ".mypy_cache" / "tree", env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
