"""scripts/check_imports.py: the tree keeps its import rules, and the check sees each kind of breach."""

from __future__ import annotations

from pathlib import Path

from scripts.check_imports import findings


def test_the_tree_keeps_its_import_rules() -> None:
    assert findings() == []


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_each_breach_is_found(tmp_path: Path) -> None:
    write(tmp_path, {
        "shared/__init__.py": "", "shared/core/__init__.py": "",
        "shared/core/a.py": "def f():\n    from cmemi.shared.core import b\n",  # a cycle through a function's import
        "shared/core/b.py": "from cmemi.shared.core import a\nfrom cmemi.services.x import server\n",
        "services/__init__.py": "", "services/x/__init__.py": "", "services/y/__init__.py": "",
        "services/x/server.py": "from cmemi.services.y.server import run\n",
        "services/y/server.py": "from cmemi.shared.core import c\nrun = c._hidden\n",
        "shared/core/c.py": "_hidden = 1\n",
        "tests/test_z.py": "from cmemi.shared.core.a import _helper\n",
    })
    found = findings(tmp_path)
    assert found == [
        "shared/core/b.py:2: shared/ imports a service (cmemi.services.x.server)",
        "services/x/server.py:1: service 'x' imports service 'y' (cmemi.services.y.server)",
        "services/y/server.py:2: private name '_hidden' imported from cmemi.shared.core.c",
        "tests/test_z.py:1: private name '_helper' imported from cmemi.shared.core.a",
        "import cycle: cmemi.shared.core.a <-> cmemi.shared.core.b",
    ], found
