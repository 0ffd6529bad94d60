"""Who is a worker of this term, for the leader and for every shard alike (one rule, one place).

- `ROLE_OF`: the key role (CurveZMQ, `shared.security`) each message type must come from.
- `Admission`: a hello is admitted only if its incarnation is the one Redis holds for that worker id
  (a forged hello with a huge incarnation, or a stale process, is turned away with Curve on or off), it
  is not fenced (here or in Redis), its dataset fingerprint is the run's, and its environment would give
  the same bits (`EnvironmentCheck`). Later messages must come from an admitted, unfenced incarnation of
  the current term (`known`). A worker id has one live incarnation: admitting one fences the older.
- `LeaseSeal`: the leader seals each lease it hands out (an HMAC over term, step, node and holder with a key
  made per term and given to the shards when they join); a shard takes a gradient slice only under a valid
  seal, so an admitted worker cannot inject a microbatch it was not leased into any shard.
Every refusal is counted through the server's `Drops` (services/aggregator/common/intake.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.core.environment import OWN, SHARED, differences

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
        self.own = own  # this server's environment (shared.environment.environment)
        self.first: dict[str, str] | None = None  # the shared fields of the first worker that said hello

    def differences(self, env: dict[str, Any] | None) -> list[str]:
        """What in a worker's environment differs (from ours, or from the first worker's); empty: nothing."""
        if self.first is None and env is not None:
            self.first = {f: str(env.get(f)) for f in SHARED}
        return differences(env, self.own, OWN) + differences(env, self.first or {}, SHARED if self.first else ())


@dataclass
class WorkerInfo:
    wid: str
    inc: int
    host: str


Reply = Callable[..., object]  # reply(identity, "reject", fatal=..., reason=...); what it returns is not read


class Admission:
    """The admitted workers of this server (identity -> WorkerInfo) and the fences it knows."""

    def __init__(self, client: redis.Redis, keys: Keys, same_data: Callable[[dict[str, Any]], bool],
                 environment: EnvironmentCheck, require_same_environment: bool, reply: Reply,
                 drop: Callable[[str, str], None], log: Any) -> None:
        # same_data(fp): is a worker's dataset fingerprint the run's (services/aggregator/common/dataprint.py)?
        self.client, self.keys, self.same_data, self.environment = client, keys, same_data, environment
        self.require_same, self.reply, self.drop, self.log = require_same_environment, reply, drop, log
        self.workers: dict[bytes, WorkerInfo] = {}
        self.fenced: dict[str, int] = {}  # worker id -> the newest fenced incarnation

    def _refuse(self, identity: bytes, reason: str, detail: str, answer: str, fatal: bool = False) -> None:
        self.drop(reason, detail)
        self.reply(identity, "reject", fatal=fatal, reason=answer)

    def hello(self, identity: bytes, h: dict[str, Any]) -> WorkerInfo | None:
        """Admit a hello, or refuse it (counted, answered); the newly admitted worker, or None."""
        wid, inc, host = h["wid"], h["inc"], h["host"]
        if (why := registered(self.client, self.keys, wid, inc)) is not None:
            # Not the incarnation Redis holds for this id: a forgery or a stale process. The reply says nothing
            # the sender did not know (no incarnation, no dataset hash); a real worker retries after registering.
            self._refuse(identity, why, f"{wid}/{inc}", f"worker {wid} on host {host}: incarnation {inc} is not "
                         f"registered for it ({why}); say hello after registering")
            return None
        if self.is_fenced(wid, inc, ask_redis=True):
            self._refuse(identity, "fenced", f"{wid}/{inc}", f"incarnation {inc} of worker {wid} is fenced")
            return None
        fp = h["fp"]
        if not self.same_data(fp):  # names the worker's own fingerprint only: the reply reveals no hash of ours
            self._refuse(identity, "wrong_dataset", f"{wid}/{inc}", fatal=True, answer=(
                f"worker {wid} on host {host} has a different dataset (length {fp.get('length')}, sha256 "
                f"{str(fp.get('sha256'))[:12]}) than the run's; make data.factory/data.kwargs give the same "
                "data on every host (compare the fingerprints in each service's log)"))
            return None
        if diff := self.environment.differences(h["env"]):
            what = (f"worker {wid} on host {host} has a different environment: {', '.join(diff)}; results would "
                    "not be bitwise equal")
            if self.require_same:
                self._refuse(identity, "wrong_environment", f"{wid}/{inc}", fatal=True, answer=(
                    f"{what}; install the same torch and hardware everywhere, or set "
                    "cluster.require_same_environment: false to admit it anyway"))
                return None
            self.log.warning("environment differs (admitted: cluster.require_same_environment is false)", detail=what)
        info = WorkerInfo(wid, inc, host)
        self.fence(wid, inc - 1)  # a worker id has one live incarnation: the newest
        self.workers[identity] = info
        return info

    def known(self, identity: bytes, kind: str, h: dict[str, Any], term: int) -> WorkerInfo | None:
        """The admitted worker a want/grad/pull (`kind`) comes from, or None (refused: counted, answered). A fenced
        sender's drop names the message's kind: a stale gradient dropped is told from a stale want or pull."""
        wid, inc = h["wid"], h["inc"]
        if self.is_fenced(wid, inc):
            self._refuse(identity, "fenced", f"{wid}/{inc} {kind}", f"incarnation {inc} of worker {wid} is fenced")
            return None
        info = self.workers.get(identity)
        if info is None or info.wid != wid or info.inc != inc:
            self._refuse(identity, "unknown_worker", f"{wid}/{inc}", "unknown worker: say hello first")
            return None
        if h.get("term") not in (None, term):
            self._refuse(identity, "wrong_term", f"{wid}: term {h.get('term')}, current {term}",
                         f"term {term} started: say hello again")
            return None
        return info

    def is_fenced(self, wid: str, inc: int, ask_redis: bool = False) -> bool:
        if self.fenced.get(wid, 0) >= inc:
            return True
        if not ask_redis:
            return False
        try:  # the coordinator records every fence in Redis before it sends one
            recorded = self.client.get(self.keys.fence("worker", wid))
        except redis.RedisError:
            return False
        if recorded is not None and int(recorded) >= inc:
            self.fence(wid, int(recorded))
            return True
        return False

    def fence(self, wid: str, max_inc: int) -> list[WorkerInfo]:
        """Incarnations <= max_inc of `wid` are dead: forget the admitted ones; returns them."""
        if max_inc <= self.fenced.get(wid, 0):
            return []
        self.fenced[wid] = max_inc
        gone = [i for i, w in self.workers.items() if w.wid == wid and w.inc <= max_inc]
        return [self.workers.pop(i) for i in gone]

    def leave(self, identity: bytes) -> WorkerInfo | None:
        return self.workers.pop(identity, None)

    def admitted(self, identity: bytes) -> bool:
        return identity in self.workers


class LeaseSeal:
    """HMAC-SHA256 (16 bytes) over a lease: (term, step, lo, hi, worker id, incarnation)."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def seal(self, term: int, step: int, lo: int, hi: int, wid: str, inc: int) -> bytes:
        text = f"{term}:{step}:{lo}:{hi}:{wid}:{inc}".encode()
        # one-shot (OpenSSL's HMAC in C), the same bytes as hmac.new(...).digest(): the leader seals every lease, and
        # the HMAC object's Python set-up cost 5.1 us a seal against 2.9 (python -m timeit, a 16-byte text)
        return hmac.digest(self.key, text, "sha256")[:16]

    def valid(self, token: bytes, term: int, step: int, lo: int, hi: int, wid: str, inc: int) -> bool:
        """`token`: the gradient's `lease` (b"" when it sent none: never valid)."""
        return hmac.compare_digest(token, self.seal(term, step, lo, hi, wid, inc))
