"""Config checks every section shares: the one config error and the helpers that name the field, value and fix."""

from __future__ import annotations

import typing
from typing import Any

from cmemi.shared.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value is missing, malformed or inconsistent; the message names the field and the fix."""


def fail(path: str, value: Any, why: str, fix: str) -> typing.NoReturn:
    """Raise the ConfigError of field `path`: its value, why it is wrong and how to fix it (one line)."""
    raise ConfigError(f"config field '{path}' = {value!r}: {why}; {fix}")


def positive(path: str, value: float, fix: str) -> None:
    """`value` must be > 0."""
    if value <= 0:
        fail(path, value, "must be > 0", fix)


def import_path(path: str, value: str | None, optional: bool = False) -> None:
    """`value` must be an import path 'package.module:attribute' (or None when `optional`)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or ":" not in value:
        fail(path, value, "must be an import path 'package.module:attribute'", f"set {path} to e.g. 'cmemi.examples.digits:make_model'")
