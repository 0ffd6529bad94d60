"""Redis reads off a service's loop: a thread of their own that keeps the last answer.

A loop that moves gradients or parameters (the leader's, a shard's, a worker's) must not wait on Redis for
what it only checks now and then (a new term, the run's end, a fence). Over a loaded link one round trip
takes as long as the queue ahead of it: in bench/cluster.py at N = 8 a shard's term and run-state reads took
15 ms on average and held its loop 11 % of the time, and while it waits the whole cluster's step waits.
`Watch` reads every `interval` seconds on its own thread; the loop takes the newest answer when it has one.
`poke` asks for a reading now: a worker whose leader went silent (SIGKILLed) learns the restarted leader's address
within a read instead of up to `interval` later (a leader kill's timeline in bench/recovery.py: the workers' 1 s
read was 0.2-0.8 s of the 1.3-2.6 s from the kill to the next new step). `fresh` pokes and waits (bounded) for that
very reading: a loop that checks only when idle compares the record as it is now, not as it was at its previous idle
check (issue 47: a worker polled at each 100 ms idle wait saw the new leader's record one wait late, 0.1-0.2 s after
it was written, at the worst kill point).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import redis

T = TypeVar("T")


class Watch(Generic[T]):
    def __init__(self, client: redis.Redis, interval: float, read: Callable[[redis.Redis], T], name: str) -> None:
        self.client, self.interval, self.read = client, interval, read
        self._lock = threading.Condition()  # (notified at the end of each read: `fresh` waits for one)
        self._new: tuple[T] | None = None  # the newest answer not taken yet
        self._begun = self._ended = 0  # reads started, and the number of the newest one ended (failed or not)
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by `poke` (and `stop`): read now
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)

    def start(self) -> Watch[T]:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._begun += 1
                number = self._begun
            try:
                value = self.read(self.client)
            except redis.RedisError:
                with self._lock:  # Redis down or restarting: nothing new to tell; the next read tries again
                    self._ended = number
                    self._lock.notify_all()
            else:
                with self._lock:
                    self._new, self._ended = (value,), number
                    self._lock.notify_all()
            self._wake.wait(self.interval)
            self._wake.clear()

    def take(self) -> tuple[T] | None:
        """The newest answer, once: `(value,)`, or None if nothing was read since the last call."""
        with self._lock:
            new, self._new = self._new, None
        return new

    def poke(self) -> None:
        """Read now, not `interval` after the last reading (the answer is `take`n as usual)."""
        self._wake.set()

    def fresh(self, timeout: float) -> tuple[T] | None:
        """A reading begun after this call (`poke`d now), once, as `take` gives it; waited for at most `timeout`
        seconds (Redis slow or away: what was read meanwhile, or None, and the loop goes on)."""
        with self._lock:
            wanted = self._begun + 1  # (a read under way may have begun before the record changed: the next one)
            self._wake.set()
            self._lock.wait_for(lambda: self._ended >= wanted or self._stop.is_set(), timeout)
            new, self._new = self._new, None
        return new

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            self._lock.notify_all()  # (a `fresh` waiting returns now)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
