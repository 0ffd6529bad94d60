"""Who may say what to the aggregator, and when an outstanding lease is handed out again.

- `ROLE_OF`: the key role (CurveZMQ, `shared.security`) each message type must come from.
- `registered`: a hello's incarnation must be the one Redis holds for that worker id — a forged
  hello (a huge incarnation that would fence the real worker) or a stale process is turned away,
  with Curve on or off.
- `EnvironmentCheck`: bitwise equality needs the same torch, threads and CPU kernels as the aggregator,
  and the same device kind and GPU model as the first admitted worker.
- `ReissuePolicy`: how long a lease may be outstanding, while the queue is empty and workers idle,
  before the next idle worker gets it too: twice the recent lease-to-gradient time per microbatch
  (an exponential average; a lease of n microbatches waits n times as long), so a withheld lease costs about one recomputation, not `lease_timeout`, and an honest
  step's tail is not duplicated.
"""

from __future__ import annotations

from typing import Any

import redis
from cmemi.shared.environment import OWN, SHARED, differences
from cmemi.shared.keys import Keys

ROLE_OF = {"hello": "worker", "want": "worker", "grad": "worker", "leave": "worker", "pull": "worker",
           "fence": "coordinator", "shard_join": "aggregator", "shard_have": "aggregator", "shard_ready": "aggregator",
           "shard_eval": "aggregator", "shard_final": "aggregator"}


def registered(client: redis.Redis, keys: Keys, wid: str, inc: int) -> str | None:
    """None if `inc` is the incarnation Redis holds for worker `wid`, else the drop reason."""
    try:
        current = client.hget(keys.member("worker", wid), "incarnation")
    except redis.RedisError:
        return "unverified_hello"  # Redis is away: the worker says hello again shortly
    return None if current is not None and current == str(inc) else "unregistered_incarnation"


class EnvironmentCheck:
    def __init__(self, own: dict[str, str]) -> None:
        self.own = own  # the aggregator's environment (shared.environment.environment)
        self.first: dict[str, str] | None = None  # the shared fields of the first worker that said hello

    def differences(self, env: Any) -> list[str]:
        """What in a worker's environment differs (from ours, or from the first worker's); empty: nothing."""
        if self.first is None and isinstance(env, dict):
            self.first = {f: str(env.get(f)) for f in SHARED}
        return differences(env, self.own, OWN) + differences(env, self.first or {}, SHARED if self.first else ())


class ReissuePolicy:
    FACTOR = 2.0
    MIN_S = 0.05
    MIN_SAMPLES = 3

    def __init__(self) -> None:
        self.avg: float | None = None
        self.samples = 0
        self._since: dict[tuple[str, int], float] = {}

    def leased(self, info: Any, now: float) -> None:
        self._since[(info.wid, info.inc)] = now

    def accepted(self, info: Any, now: float, microbatches: int = 1) -> None:
        since = self._since.get((info.wid, info.inc))
        if since is None:
            return
        dt = (now - since) / microbatches
        self.avg = dt if self.avg is None else 0.8 * self.avg + 0.2 * dt
        self.samples += 1

    @property
    def after(self) -> float | None:
        """Seconds per microbatch a lease is outstanding before an idle worker gets it too (None: not measured yet)."""
        if self.avg is None or self.samples < self.MIN_SAMPLES:
            return None
        return max(self.MIN_S, self.FACTOR * self.avg)
