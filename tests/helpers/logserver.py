"""A real checkpointer step-log server for the step log's transport tests (services/checkpointer/logserver.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cmemi.services.checkpointer.logserver import LogServer
from cmemi.services.checkpointer.spool import Spool
from cmemi.services.checkpointer.steplog import StepLog


@contextlib.contextmanager
def log_server(tmp_path: Path, ctx: Any, zctx: Any, memory_mb: int) -> Iterator[tuple[LogServer, StepLog]]:
    """A LogServer on its own thread and socket over a StepLog holding up to `memory_mb` in memory and spilling the
    rest to spool files under `tmp_path`, advertised in Redis as the checkpointer's log; closed, and its spool files
    discarded, on exit."""
    spooled: list[Spool] = []

    def spill(header: dict, metas: list[dict]) -> Spool:
        spooled.append(Spool(tmp_path, int(header["step"]), 0, metas, lambda exc, attempt: None))
        return spooled[-1]

    log = StepLog(0, memory_mb << 20, spill)
    server = LogServer(ctx, zctx, log, threading.Lock()).start()
    ctx.redis.hset(ctx.keys.checkpointer, mapping={"addr": server.addr, "incarnation": "1", "log": server.addr})
    try:
        yield server, log
    finally:
        server.close()
        for s in spooled:
            s.discard()
