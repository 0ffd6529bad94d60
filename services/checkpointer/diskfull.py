"""A full disk while the checkpointer writes: make room once (retention, as if the checkpoint were written), try
again, and if it is still full stop with one clear line; the run resumes from the last checkpoint once there is
room. A failed write leaves nothing behind (store.py), so the newest checkpoint stays the one `latest` names."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

from cmemi.services.checkpointer import spool
from cmemi.services.checkpointer.errors import DISK_FULL
from cmemi.services.checkpointer.spool import Spooled
from cmemi.services.checkpointer.store import CheckpointStore
from cmemi.shared.runtime.service import ServiceContext


class DiskFull:
    """`latest`: the step of the newest checkpoint written (retention never removes it)."""

    def __init__(self, ctx: ServiceContext, store: CheckpointStore, latest: Callable[[], int | None]) -> None:
        self.ctx, self.store, self.latest = ctx, store, latest

    def write(self, step: int, meta: dict, tensors: dict[str, Spooled]) -> Path:
        """Write a checkpoint; on a full disk apply retention as if it were written, then try once more."""
        for attempt in (1, 2):
            try:
                return self.store.write(step, meta, tensors)
            except OSError as exc:
                if exc.errno not in spool.FULL:
                    raise
                self.full(step, exc, sum(t.nbytes for t in tensors.values()), attempt)
        raise AssertionError("not reached: stop() exits")

    def full(self, step: int, exc: OSError, need: int, attempt: int) -> None:
        """The disk filled up writing step `step`: make room once (retention, as if it were written), then stop."""
        if attempt == 2:
            self.stop(step, exc, need)
        cfg = self.ctx.cfg.checkpoint
        removed = self.store.retain(max(1, cfg.keep_last - 1), cfg.keep_every, protect=self.latest())
        self.ctx.log.warning("disk full; applied retention before writing", step=step, removed=removed)

    def stop(self, step: int, exc: OSError, need: int) -> None:
        """One clear line and a clean stop; the run resumes from the last checkpoint once there is room."""
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise exc
        free = shutil.disk_usage(self.store.root).free
        self.ctx.fatal(f"{DISK_FULL} writing checkpoint of step {step} to {self.store.root}: need "
                       f"{need / 1e6:.1f} MB, {free / 1e6:.1f} free; free some space, then continue with "
                       "`cmemi up --resume`")
