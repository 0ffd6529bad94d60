"""Every string key a service reads from a decoded message header, found by reading the source (no imports).

A header is `<anything>.header` (`msg.header`, `got.header`, `link.got[0].header`), a name assigned from one
(`h = msg.header`, `h, tensors = msg.header, msg.tensors`), or a parameter named as the services name the headers
they are handed (`h`, `header`, `hello`, `of`). A read is `h["k"]`, `h.get("k", ...)` or `"k" in h`.

Where the source says which message it is, the read is mapped to that type: inside `_on_<type>` (the handlers'
naming) or a function `handlers` names (`"Worker._work": {"work"}`), in the body of an `if` whose test is `msg.type == "work"` / `msg.type in ("saved", "skipped")` /
`h.get("type") == "slice"`, or after such a test in an `and`. Elsewhere (a helper handed `h`) it is checked against
every field any type declares. Keys computed at run time (`h[f]`) are not seen: keep them literal.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

HEADER_PARAMS = frozenset({"h", "header", "hello", "of"})
ENVELOPE = frozenset({"type", "proto", "run"})  # checked before the fields (protocol.check_header): always there


@dataclass(frozen=True)
class Read:
    path: str
    line: int
    key: str
    types: frozenset[str] | None  # the message types it can be; None: not known here

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _is_type_expr(node: ast.AST) -> bool:
    """`msg.type`, `mtype`, `h.get("type")`, `h["type"]`."""
    if isinstance(node, ast.Attribute) and node.attr == "type":
        return True
    if isinstance(node, ast.Name) and node.id == "mtype":
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "type":
        return True
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "type"


def type_test(test: ast.AST) -> frozenset[str] | None:
    """The message types a condition admits, if it tests the type (`==`, `in`; `and` of tests: the narrowest)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        found = [t for t in (type_test(v) for v in test.values) if t is not None]
        return frozenset.intersection(*found) if found else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and _is_type_expr(test.left)):
        return None
    op, right = test.ops[0], test.comparators[0]
    if isinstance(op, ast.Eq) and isinstance(right, ast.Constant) and isinstance(right.value, str):
        return frozenset({right.value})
    if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)) \
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in right.elts):
        return frozenset(e.value for e in right.elts)  # type: ignore[attr-defined]
    return None


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, known_types: frozenset[str], handlers: dict[str, frozenset[str]]) -> None:
        self.path, self.known_types, self.handlers = path, known_types, handlers
        self.reads: list[Read] = []
        self.classes: list[str] = []
        self.functions: set[str] = set()  # "Class.method" / "function" of every function seen
        self.names: list[set[str]] = [set()]  # header names, per function being visited
        self.types: list[frozenset[str] | None] = [None]  # the innermost type constraint

    # -- scopes
    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        params = {a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]}
        names = (params & HEADER_PARAMS) | {n for n in self.names[-1] if n not in params}
        for sub in ast.walk(node):  # `h = msg.header`, `h, t = msg.header, msg.tensors`
            if isinstance(sub, ast.Assign):
                for target in sub.targets:
                    pairs = zip(target.elts, sub.value.elts, strict=False) if isinstance(target, ast.Tuple) \
                        and isinstance(sub.value, ast.Tuple) else [(target, sub.value)]
                    for t, v in pairs:
                        if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and v.attr == "header":
                            names.add(t.id)
        mtype, qual = node.name.removeprefix("_on_"), ".".join([*self.classes[-1:], node.name])
        self.functions.add(qual)
        self.names.append(names)
        if qual in self.handlers:
            self.types.append(self.handlers[qual])
        else:
            self.types.append(frozenset({mtype}) if node.name.startswith("_on_") and mtype in self.known_types
                              else self.types[-1])
        self.generic_visit(node)
        self.names.pop()
        self.types.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function  # noqa: N815

    def visit_ClassDef(self, node: ast.ClassDef) -> None:  # noqa: N802
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def _narrowed(self, test: ast.AST, body: list[ast.AST]) -> None:
        self.visit(test)
        self.types.append(type_test(test) or self.types[-1])
        for stmt in body:
            self.visit(stmt)
        self.types.pop()

    def visit_If(self, node: ast.If) -> None:  # noqa: N802
        self._narrowed(node.test, node.body)
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:  # noqa: N802
        if not isinstance(node.op, ast.And):
            self.generic_visit(node)
            return
        pushed = 0
        for value in node.values:
            self.visit(value)
            if (t := type_test(value)) is not None:
                self.types.append(t)
                pushed += 1
        del self.types[len(self.types) - pushed:]

    # -- reads
    def _is_header(self, node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "header") or \
            (isinstance(node, ast.Name) and node.id in self.names[-1])

    def _read(self, node: ast.AST, key: object) -> None:
        if isinstance(key, str):
            self.reads.append(Read(self.path, node.lineno, key, self.types[-1]))

    def visit_Subscript(self, node: ast.Subscript) -> None:  # noqa: N802
        if isinstance(node.ctx, ast.Load) and self._is_header(node.value) and isinstance(node.slice, ast.Constant):
            self._read(node, node.slice.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "get" and self._is_header(f.value) and node.args \
                and isinstance(node.args[0], ast.Constant):
            self._read(node, node.args[0].value)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:  # noqa: N802
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) and self._is_header(node.comparators[0]) \
                and isinstance(node.left, ast.Constant):
            self._read(node, node.left.value)
        self.generic_visit(node)


def scan_source(source: str, path: str, known_types: frozenset[str],
                handlers: dict[str, frozenset[str]] | None = None) -> tuple[list[Read], set[str]]:
    """The header reads in one module's source, and the names of its functions (`Class.method`)."""
    scanner = _Scanner(path, known_types, handlers or {})
    scanner.visit(ast.parse(source, path))
    return scanner.reads, scanner.functions


def scan(root: Path, dirs: tuple[str, ...], known_types: frozenset[str],
         handlers: dict[str, frozenset[str]] | None = None) -> tuple[list[Read], set[str]]:
    """Every header read in the .py files under root/dirs (paths relative to root), and every function's name."""
    reads: list[Read] = []
    functions: set[str] = set()
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            found, names = scan_source(path.read_text(), str(path.relative_to(root)), known_types, handlers)
            reads += found
            functions |= names
    return reads, functions


def undeclared(reads: list[Read], schemas: dict[str, set[str]]) -> list[str]:
    """'file:line: field "k" ...' for each read of a field its message type (or, type unknown, every type) lacks."""
    everywhere = set().union(*schemas.values()) | ENVELOPE
    out = []
    for r in reads:
        if r.key in ENVELOPE:
            continue
        if r.types is not None and (lacking := sorted(t for t in r.types if r.key not in schemas.get(t, set()))):
            out.append(f"{r.where()}: field {r.key!r} is read from a {'/'.join(lacking)} message, which does not "
                       f"declare it (shared/wire/messages/)")
        elif r.types is None and r.key not in everywhere:
            out.append(f"{r.where()}: field {r.key!r} is read from a message header, and no message type declares it "
                       f"(shared/wire/messages/)")
    return out
