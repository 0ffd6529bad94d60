"""Rewrite this process's command line (/proc/PID/cmdline, what `ps`, `pgrep -f` and chaos scripts read).

A process forked by the zygote must show its role exactly as if it had been started with that command
line: `python -m cmemi worker --config ... --worker-id w1`, one argument per NUL-separated string (a
restarted coordinator adopts services by comparing these lists). `setproctitle` cannot do that: it writes
one space-joined string, which the kernel shows as a single argument. Here the arguments are written into
the original argv area, NUL-separated and NUL-padded: they must fit in it, so the zygote starts with a
long enough command line (`ROOM`). Linux only.
"""

from __future__ import annotations

import ctypes

ROOM = 4096  # bytes of argv area the zygote reserves for its children's command lines


def _argv_area() -> tuple[int, int]:
    """(start, end) addresses of this process's argv strings (/proc/self/stat fields 48 and 49)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[45]), int(fields[46])  # fields after the name start at field 3


def room() -> int:
    """How many bytes a new command line may take (its NULs included)."""
    try:
        start, end = _argv_area()
    except (OSError, ValueError, IndexError):
        return 0
    return end - start


def encoded(argv: list[str]) -> bytes:
    return b"".join(a.encode() + b"\0" for a in argv)


def set_cmdline(argv: list[str]) -> bool:
    """Make /proc/self/cmdline read `argv` (then NULs); False, changing nothing, when it does not fit."""
    data = encoded(argv)
    try:
        start, end = _argv_area()
    except (OSError, ValueError, IndexError):
        return False
    if not data or len(data) > end - start:
        return False
    # the stack's argv strings: Python keeps its own copies of them (sys.argv, sys.orig_argv)
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)
    return True
