"""Check the import rules of the tree: `python scripts/check_imports.py` (exit 1 on any finding, one line each).

The rules (STYLE.md: the layers read top-down with no arrow back up):

- no import cycle between modules of `cmemi.*` (imports inside functions included: a cycle there still means two
  modules that each need the other, only discovered later);
- no private name (a leading underscore) taken from another module, by `from m import _x` or as `m._x`: what
  another module needs is public, or it belongs where both can reach it;
- services never import each other (`services/X` never imports `services/Y`), and `shared/` imports no service.

The graph is built from the source (ast), not by importing it: every .py file of the package (cmemi/, shared/,
services/, examples/, mapped as pyproject.toml maps them), and tests/, bench/, scripts/ and docker/ as importers of
it (they are not part of any cycle, but their private imports count).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = {"cmemi": "cmemi", "shared": "cmemi.shared", "services": "cmemi.services", "examples": "cmemi.examples"}
IMPORTERS = ("tests", "bench", "scripts", "docker")


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted name of a file of the tree: shared/wire/protocol.py -> cmemi.shared.wire.protocol."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] in PACKAGE:
        parts[0:1] = PACKAGE[parts[0]].split(".")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package and of its importers, by dotted name."""
    out: dict[str, Path] = {}
    for top in (*PACKAGE, *IMPORTERS):
        for path in sorted((root / top).rglob("*.py")):
            if ".venv" not in path.parts:
                out[module_name(path, root)] = path
    return out


def resolve(module: str, level: int, current: str, is_package: bool) -> str:
    """The absolute name of `from {'.' * level}{module} import ...` written in `current`."""
    if not level:
        return module
    base = current.split(".")
    base = base[: len(base) - level + (1 if is_package else 0)]
    return ".".join([*base, module] if module else base)


def imports(name: str, path: Path, known: set[str]) -> Iterator[tuple[int, str, str | None]]:
    """(line, imported module, private name taken from it or None) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # a local name bound to a module of the tree
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known or a.name.startswith("cmemi."):
                    yield node.lineno, a.name, None
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node.module or "", node.level, name, path.name == "__init__.py")
            for a in node.names:
                sub = f"{source}.{a.name}"
                if sub in known:  # a module taken from its package
                    yield node.lineno, sub, None
                    aliases[a.asname or a.name] = sub
                elif source in known or source.startswith("cmemi."):
                    yield node.lineno, source, a.name if a.name.startswith("_") and not a.name.startswith("__") else None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            yield node.lineno, aliases[node.value.id], node.attr


def service(module: str) -> str | None:
    """The service a module belongs to (cmemi.services.worker.links.inbox -> worker), or None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["cmemi", "services"] else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    scc.append(top)
                    if top == node:
                        break
                if len(scc) > 1:
                    out.append(sorted(scc))
    return out


def findings(root: Path = ROOT) -> list[str]:
    """Every finding in the tree at `root`, one line each (file:line: what), cycles last."""
    files = sources(root)
    known = set(files)
    graph: dict[str, set[str]] = {}
    out: list[str] = []
    for name, path in files.items():
        where = path.relative_to(root)
        in_package = name.startswith("cmemi.") or name == "cmemi"
        for line, target, private in imports(name, path, known):
            if private is not None and target != name:
                out.append(f"{where}:{line}: private name {private!r} imported from {target}")
            if not in_package or target == name:
                continue
            if target in known:
                graph.setdefault(name, set()).add(target)
            mine, theirs = service(name), service(target)
            if theirs is not None and mine is not None and mine != theirs:
                out.append(f"{where}:{line}: service {mine!r} imports service {theirs!r} ({target})")
            if theirs is not None and name.startswith("cmemi.shared"):
                out.append(f"{where}:{line}: shared/ imports a service ({target})")
    for scc in cycles(graph):
        out.append("import cycle: " + " <-> ".join(scc))
    return out


def main() -> int:
    found = findings()
    for line in found:
        print(line)
    print(f"check_imports: {len(found)} finding(s)" if found else "check_imports: clean")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
