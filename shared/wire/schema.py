"""The run-time side of shared/wire/messages/: each declared field as `protocol.check_header` checks it.

The TypedDicts there are what a type checker sees; this reads their annotations once, at import, into `Field`s
(`int` -> (int,), `float` -> (int, float), `X | None` -> (X, NoneType), `Any` -> any value), so the check and the
types cannot drift apart: there is one declaration.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, Union, cast

from cmemi.shared.wire.messages import ABSENT, KINDS, Absent, Default, Tensor


@dataclass(frozen=True)
class Field:
    """One declared field, as checked at run time: the Python types msgpack may decode it as (`object`: any)."""
    types: tuple[type, ...]
    required: bool = True
    default: Any = ABSENT
    anything: bool = dataclasses.field(init=False, repr=False, compare=False)  # `Any`: its reader checks it
    bools: bool = dataclasses.field(init=False, repr=False, compare=False)  # bool is one of the types

    def __post_init__(self) -> None:  # (every message checks every field: ~0.2 us each, not a tuple search)
        object.__setattr__(self, "anything", self.types == (object,))
        object.__setattr__(self, "bools", bool in self.types)

    def accepts(self, value: Any) -> bool:
        """Of one of the types; a bool only where bool is named (Python's bool is an int: `True` is no step)."""
        return self.anything or (isinstance(value, self.types) and (self.bools or value.__class__ is not bool))

    def fill(self) -> Any:
        """The value an absent optional field reads as (a fresh copy of a mutable default: never shared)."""
        return copy.copy(self.default) if isinstance(self.default, (list, dict)) else self.default


def _runtime_types(hint: Any) -> tuple[type, ...]:
    """int -> (int,), float -> (int, float), dict[str, Any] -> (dict,), X | None -> (X, NoneType), Any -> (object,)."""
    if hint is Any:
        return (object,)
    if hint is float:
        return (int, float)
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _runtime_types(arg))
    if hint is type(None):
        return (type(None),)
    if origin in (dict, list):
        return (origin,)
    if hint in (int, str, bool, bytes):
        return (hint,)
    raise TypeError(f"a wire field of type {hint!r}: use int, float, str, bool, bytes, dict, list, X | None or Any")


def fields(kind: type) -> dict[str, Field]:
    """The run-time fields of a TypedDict of messages.py, in declaration order (base classes' first)."""
    out = {}
    for name, hint in typing.get_type_hints(kind, include_extras=True).items():
        if typing.get_origin(hint) is Annotated:
            hint, *marks = typing.get_args(hint)
            mark = next(m for m in marks if isinstance(m, (Default, Absent)))
            out[name] = Field(_runtime_types(hint), False, mark.value if isinstance(mark, Default) else ABSENT)
        else:
            out[name] = Field(_runtime_types(hint))
    return out


# type -> {field: Field}: what `protocol.check_header` checks and fills in
SCHEMAS: dict[str, dict[str, Field]] = {mtype: fields(kind) for mtype, kind in KINDS.items()}
TENSOR: dict[str, Field] = fields(Tensor)


def required(mtype: str) -> dict[str, tuple[type, ...]]:
    """A message type's required fields and their types, in declaration order (what a minimal message carries)."""
    return {name: f.types for name, f in SCHEMAS[mtype].items() if f.required}


H = TypeVar("H")


def of(header: dict[str, Any], kind: type[H]) -> H:
    """A decoded header as its TypedDict, after checking that it is that type's (decode checked its fields and filled
    in the defaults): `h = schema.of(msg.header, Work)`, and mypy knows `h["last"]` is a bool and `h["ahead"]` an
    error (a work message has none)."""
    mtype = header.get("type")
    if mtype not in KINDS or KINDS[mtype] is not kind:
        raise TypeError(f"a {mtype!r} header read as {kind.__name__}")
    return cast(H, header)
