"""Progress for `cmemi up`'s bar and `cmemi status`, written to Redis off the leader's loop.

The leader publishes progress at most every 0.1 s. A round trip on its loop would hold every worker's next
lease for as long as the round trip takes (over a loaded link, tens of milliseconds: shared/coordination/watch.py), so a
thread of its own writes it: the newest progress replaces one not written yet, accepted microbatches per
worker add up until written, and what a failed write (Redis restarting) carried goes with the next one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping

import redis
from cmemi.shared.coordination.keys import Keys
from redis.typing import EncodableT, FieldT


class ProgressWriter:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self._cond = threading.Condition()
        self._fields: dict[FieldT, EncodableT] | None = None  # the newest progress, not written yet
        self._counts: Counter[str] = Counter()  # accepted microbatches per "wid:incarnation", not written yet
        self._busy = False  # a write is on its way
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()

    def put(self, fields: Mapping[str, EncodableT], microbatches: Mapping[str, int]) -> None:
        with self._cond:
            self._fields = {k: v for k, v in fields.items()}  # (typed as the keys and values redis-py takes)
            self._counts.update(microbatches)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._fields is None and not self._counts and not self._closed:
                    self._cond.wait()
                if self._closed and self._fields is None and not self._counts:
                    return
                fields, counts = self._fields, self._counts
                self._fields, self._counts, self._busy = None, Counter(), True
            ok = self._write(fields, counts)
            with self._cond:
                self._busy = False
                if not ok:  # Redis down: keep what was not written, newer progress first
                    self._fields = self._fields if self._fields is not None else fields
                    self._counts.update(counts)
                self._cond.notify_all()
                if not ok:
                    self._cond.wait(0.2)  # retry shortly, or sooner with new progress
                    if self._closed:
                        return

    def _write(self, fields: dict[FieldT, EncodableT] | None, counts: Counter[str]) -> bool:
        try:
            pipe = self.client.pipeline(transaction=False)
            if fields is not None:
                pipe.hset(self.keys.progress, mapping=fields)
            for worker, n in counts.items():
                pipe.hincrby(self.keys.microbatches, worker, n)
            pipe.execute()
            return True
        except redis.RedisError:  # progress is cosmetic; Redis may be restarting
            return False

    def flush(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until what was put is written: the last step's progress before the run is
        marked complete."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._fields is not None or self._counts or self._busy) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, min(0.1, deadline - time.monotonic())))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=2)
