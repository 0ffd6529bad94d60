"""The user's optimizer and scheduler step on an aggregator (leader or shard): if it raises, the run stops with
one fatal error that names the step and what to check, since restarting would fail the same way."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def users_step(fatal: Callable[[str], None], step: int, where: str = "") -> Iterator[None]:
    """`where`: who steps, as the message says it (" on shard 2"); the leader's says nothing."""
    try:
        yield
    except Exception as exc:  # the user's optimizer/scheduler: restarting would fail the same way
        fatal(f"optimizer/scheduler failed at step {step}{where}: {type(exc).__name__}: {exc}; "
              "check optimizer.kwargs and scheduler.kwargs")
