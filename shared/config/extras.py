"""Optional dependencies (pyproject extras): a missing one is reported in one line naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType

from cmemi.shared.errors import UserError


class MissingExtra(UserError, RuntimeError):
    """An optional dependency is not installed; the message names the pip extra that brings it."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import `module`, or raise MissingExtra: "<purpose> needs <module>: pip install 'cmemi[<extra>]'"."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{purpose} needs the Python package {module!r}, which is not installed: "
                           f"pip install 'cmemi[{extra}]'") from None
