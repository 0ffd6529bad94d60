"""Errors raised in user code (model, dataset, collate, loss, evaluation), said in one line with where.

A deterministic error in user code fails the same way wherever and however often it runs: restarting
the process only repeats it. `where` finds the frame that names the user's code (skipping CMEMI's own
library, torch, numpy and the standard library when a deeper frame exists), and `Failure` is what two
failures are compared by.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from dataclasses import dataclass
from types import TracebackType

import numpy
import torch
from cmemi.shared.errors import UserError

_LIBRARY = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (torch, numpy)) + tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), d) + os.sep
    for d in ("shared", "services")) + (sysconfig.get_paths()["stdlib"] + os.sep,)


@dataclass(frozen=True)
class Failure:
    kind: str  # exception type name
    text: str  # str(exception), one line
    function: str
    location: str  # file:line

    def line(self) -> str:
        return f"{self.kind}: {self.text} (raised in {self.function}, {self.location})"


def where(tb: TracebackType | None) -> tuple[str, str]:
    """(function, 'file:line') of the innermost frame in user code; the innermost frame if none is."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return "?", "?"
    chosen = next((f for f in reversed(frames) if not os.path.abspath(f.filename).startswith(_LIBRARY)), frames[-1])
    name = chosen.filename
    try:
        rel = os.path.relpath(name)
        name = rel if not rel.startswith("..") else name
    except ValueError:
        pass
    return chosen.name, f"{name}:{chosen.lineno}"


class RemoteFailure(UserError):
    """A failure of user code in another process of ours (a data loader), carried back as its description."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.text)
        self.failure = failure


def describe(exc: BaseException) -> Failure:
    if isinstance(exc, RemoteFailure):
        return exc.failure
    function, location = where(exc.__traceback__)
    text = " ".join(str(exc).split())[:300]
    return Failure(type(exc).__name__, text, function, location)
