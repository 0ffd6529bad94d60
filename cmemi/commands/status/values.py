"""Loose values from Redis hashes and JSON lines, read the same way by both sources of a report."""

from __future__ import annotations

from typing import Any

FINAL_STATES = ("completed", "failed")  # a run in one of these states changes no more: --watch stops


def number(value: Any, kind: type = float) -> Any:
    """`value` as a `kind`, None when missing or unreadable: a report shows "-" rather than failing on one field."""
    if value is None or value == "":
        return None
    try:
        return kind(float(value)) if kind is int else kind(value)
    except (TypeError, ValueError):
        return None


def natural_key(ident: str) -> tuple:
    """Sort key that puts w2 before w10."""
    head = ident.rstrip("0123456789")
    tail = ident[len(head):]
    return head, int(tail) if tail else -1
