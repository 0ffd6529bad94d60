"""Every exit code a CMEMI process ends with, in one place: what the supervisor (the coordinator, `cmemi up`, an
orchestrator's restart policy) should do when it sees one.

`UNKNOWN` is not an exit status the kernel gives: the supervisor records it for an adopted process (not its child),
whose status cannot be read. And how a process leaves: `exit_now` skips the interpreter's teardown but still runs
what `at_exit` registered (files that must not outlive the process: ipc:// sockets, shared-memory segments)."""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn


class Exit(enum.IntEnum):
    OK = 0  # done: the run completed (or this process was asked to stop)
    CRASH = 1  # an unexpected error: restart it, with backoff, at most cluster.max_restarts times
    FATAL = 2  # a user error (config, user code, data): restarting will not help; one line said why
    FENCED = 3  # this incarnation was declared dead (fenced): the supervisor starts a fresh one
    REJOIN = 4  # a parameter-server shard leaves a term that went back to a checkpoint: restart it at once
    UNKNOWN = -1000  # an adopted process (not our child) exited: its exit code cannot be read


HANDLERS: list[Callable[[], object]] = []  # what `at_exit` registered, for `exit_now`


def at_exit(fn: Callable[[], object]) -> None:
    """Run `fn` when this process leaves: through the interpreter's exit (atexit) or by `exit_now`. It may run twice
    where both happen (never in one process: os._exit ends it), so it must be idempotent."""
    atexit.register(fn)
    HANDLERS.append(fn)


def exit_now(code: int) -> NoReturn:
    """Leave without tearing the interpreter down: with torch imported that takes 0.5-0.8 s, which every process
    of a finished run paid one after another before `cmemi up` returned (cmemi/cli.py), and a service the zygote
    forked paid before its restart. Only where the sockets are closed by now (their ZeroMQ context terminated: what
    is still queued is sent); what `at_exit` registered runs here (os._exit runs no atexit handler: the ipc:// socket
    files were left behind without it, tests/test_samehost_faults.py), then the logs and standard streams are
    flushed."""
    while HANDLERS:
        with contextlib.suppress(Exception):
            HANDLERS.pop()()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
