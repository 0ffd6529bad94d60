"""Dropped messages: counted by reason, not logged one by one, and mirrored to Redis (ckpt:dropped).

A flood of hostile or malformed messages must not become a flood of log lines: the first three of each reason
are logged, then every thousandth. The counts reach summary.json through Redis, published in batches (at
most once a second, and before each checkpoint's ack, as the final summary reads them right after it).
"""

from __future__ import annotations

from collections import Counter

import redis
import structlog
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.runtime import metrics


class Drops:
    def __init__(self, client: redis.Redis, keys: Keys, log: structlog.stdlib.BoundLogger) -> None:
        self.client, self.keys, self.log = client, keys, log
        self.counts: Counter[str] = Counter()  # by reason, since this process started
        self.unpublished: Counter[str] = Counter()  # not in Redis yet

    def count(self, reason: str, detail: str = "") -> None:
        self.counts[reason] += 1
        self.unpublished[reason] += 1
        metrics.DROPPED.labels(reason).inc()
        if self.counts[reason] <= 3 or self.counts[reason] % 1000 == 0:
            self.log.warning("message dropped", reason=reason, detail=detail[:200], count=self.counts[reason])

    def publish(self) -> None:
        """Add the new counts to Redis; kept for the next call while Redis is away."""
        if not self.unpublished:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for reason, n in self.unpublished.items():
                pipe.hincrby(self.keys.ckpt_dropped, reason, n)
            pipe.execute()
            self.unpublished.clear()
        except redis.RedisError:
            pass  # next time
