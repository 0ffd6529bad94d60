"""The config reference table (Markdown) from the schema's field docstrings: `python scripts/config_reference.py` prints it;
scripts/readme_tables.py writes it into docs/reference/config.md, and tests/test_readme.py checks it is current."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import typing

from cmemi.shared.config import schema as C


def field_docs() -> dict[tuple[str, str], str]:
    """(class, field) -> the field's docstring, over every module that declares a section of the schema."""
    hints = typing.get_type_hints(C.Config)
    names = {C.__name__, *(c.__module__ for tp in hints.values() if dataclasses.is_dataclass(tp) for c in tp.__mro__)}
    docs = {}
    for node in (n for m in sorted(names - {"builtins"}) for n in ast.parse(inspect.getsource(sys.modules[m])).body):
        if isinstance(node, ast.ClassDef):
            for st, nxt in zip(node.body, node.body[1:]):  # noqa: B905 - pairs of neighbours
                if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and isinstance(nxt, ast.Expr)
                        and isinstance(nxt.value, ast.Constant)):
                    docs[(node.name, st.target.id)] = " ".join(nxt.value.value.split())  # one table row
    return docs


def rows() -> list[tuple[str, object, str]]:
    docs = field_docs()
    out = []
    hints = typing.get_type_hints(C.Config)
    for f in dataclasses.fields(C.Config):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            for g in dataclasses.fields(tp):
                default = g.default if g.default is not dataclasses.MISSING else g.default_factory()
                doc = next((docs[(c.__name__, g.name)] for c in tp.__mro__ if (c.__name__, g.name) in docs), "")
                out.append((f"{f.name}.{g.name}", default, doc))
        else:
            out.append((f.name, f.default, docs.get(("Config", f.name), "")))
    return out


def markdown() -> str:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | `{default!r}` | {doc} |" for name, default, doc in rows()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
