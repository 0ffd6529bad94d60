"""The last gradient's frames still in ZeroMQ's queues, for a big model (docs/design.md §8).

A worker sends its gradient zero-copy: until a server has read them, ZeroMQ holds the gradient's own tensors. A
lease handed out again to an idle worker (a step stalled by a snapshot's sends, a slow shard) could otherwise start
the next gradient while the last one is still queued, and the worker would hold two. So, for a model of 64 MiB or
more (shared/memory/allocator.py's threshold), the gradient's frames are tracked and the next block waits until ZeroMQ is
done with them, at most `patience_s` (a dead shard's queue is given up on, not waited for again)."""

from __future__ import annotations

import time

import zmq


class InFlight:
    def __init__(self, tracked: bool, patience_s: float) -> None:
        self.tracked, self.patience_s = tracked, patience_s
        self._trackers: list[zmq.MessageTracker] = []

    @property
    def trackers(self) -> list[zmq.MessageTracker] | None:
        """Where a gradient's sends put their trackers (None: untracked, a small model)."""
        return self._trackers if self.tracked else None

    def settle(self) -> None:
        """Wait until the last gradient's frames are sent (at most `patience_s`); then forget them."""
        deadline = time.monotonic() + self.patience_s
        for tracker in self._trackers:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                tracker.wait(left)
            except zmq.NotDone:
                break
        self._trackers.clear()
