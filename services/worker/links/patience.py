"""How long a worker waits for the aggregator before it asks again, and what the aggregator's `pending` means.

A worker that hears nothing for `reask_s` (2 x cluster.dead_after) sends `want` with `reask: n`; each further
re-ask without work in between waits twice as long (up to 16x): on a slow link silence is a transfer still
arriving. The aggregator answers a re-ask with `pending {reask: n}` while the work it last sent this worker is
unanswered (services/aggregator/leader/leasing.py). Each direction of the connection keeps order, so: if work arrived
after re-ask n was sent, that work was on its way and the answer means nothing; if not, everything this worker
sent before re-ask n reached the aggregator first, and it still waits: the work, or our gradient of it, was
lost, and the worker asks plainly (its lease goes back to the queue, new work comes). docs/design.md §2.
"""

from __future__ import annotations

import time

MAX_DOUBLINGS = 4


class Patience:
    def __init__(self, reask_s: float) -> None:
        self.reask_s = reask_s
        self.last_heard = time.monotonic()  # the last message from the aggregator, or our last request
        self.reasks = 0  # re-asks sent so far (never reset: `pending` answers are matched by number)
        self.reasks_at_work = 0  # ... when the last work arrived
        self.quiet = 0  # re-asks in a row without work in between

    def heard(self) -> None:
        """A message came, or we sent a request: the wait starts again."""
        self.last_heard = time.monotonic()

    def work_arrived(self) -> None:
        self.reasks_at_work, self.quiet = self.reasks, 0

    def due(self, now: float) -> float | None:
        """Seconds waited, if that is long enough to ask again; else None."""
        waited = now - self.last_heard
        return waited if waited > self.reask_s * 2 ** min(self.quiet, MAX_DOUBLINGS) else None

    def reask(self) -> int:
        """The number of the re-ask to send now."""
        self.reasks += 1
        self.quiet += 1
        return self.reasks

    def lost(self, reask: int) -> bool:
        """The aggregator's `pending` answer to re-ask `reask`: True if its work (or our gradient) was lost."""
        return reask > self.reasks_at_work
