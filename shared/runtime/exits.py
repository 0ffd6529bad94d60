"""Every exit code a CMEMI process ends with, in one place: what the supervisor (the coordinator, `cmemi up`, an
orchestrator's restart policy) should do when it sees one.

`UNKNOWN` is not an exit status the kernel gives: the supervisor records it for an adopted process (not its child),
whose status cannot be read."""

from __future__ import annotations

import enum
import logging
import os
import sys
from typing import NoReturn


class Exit(enum.IntEnum):
    OK = 0  # done: the run completed (or this process was asked to stop)
    CRASH = 1  # an unexpected error: restart it, with backoff, at most cluster.max_restarts times
    FATAL = 2  # a user error (config, user code, data): restarting will not help; one line said why
    FENCED = 3  # this incarnation was declared dead (fenced): the supervisor starts a fresh one
    REJOIN = 4  # a parameter-server shard leaves a term that went back to a checkpoint: restart it at once
    UNKNOWN = -1000  # an adopted process (not our child) exited: its exit code cannot be read


def exit_now(code: int) -> NoReturn:
    """Leave without tearing the interpreter down: with torch imported that takes 0.5-0.8 s, which every process
    of a finished run paid one after another before `cmemi up` returned (cmemi/cli.py). Only where all is closed by
    now: the logs and the standard streams are flushed here, nothing else."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
