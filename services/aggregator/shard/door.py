"""Which workers' hellos a shard k > 0 answers, and when (docs/design.md §4).

A shard admits workers by its leader's rule (services/aggregator/common/admission.py), with the run's dataset
fingerprint and the term's lease-seal key, which come with the leader's welcome (`shard_welcome`). Before that welcome,
a hello is parked where a worker may be linked to this shard already — it restarted within the term, or joined a new
term in place (newterm.py) — and answered once welcomed, so that worker keeps its lease meanwhile; elsewhere (the
term's start: the leader admits workers only once every shard joined) it is turned away with "say hello again".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cmemi.services.aggregator.common.admission import Admission
from cmemi.services.aggregator.common.intake import Intake

PARKED = 64  # hellos kept until the welcome (one per connection; a worker's own is said again after a timeout)


class Door:
    def __init__(self, admission: Admission, intake: Intake, send: Callable[..., object], log: Any, shard: int) -> None:
        self.admission, self.intake, self.send, self.log, self.shard = admission, intake, send, log, shard
        self.fp: dict[str, Any] | None = None  # the run's dataset fingerprint, from the leader's welcome
        self.parks = False  # restarted within the term (or joined a new one in place): a worker may be linked here
        self.parked: list[tuple[bytes, dict[str, Any]]] = []

    def agrees(self, fp: dict[str, Any]) -> bool:
        """Is a worker's dataset fingerprint the run's (as the leader said)?"""
        return fp == self.fp

    def hello(self, identity: bytes, h: dict[str, Any], term: int, step: int, total: int) -> None:
        if self.fp:
            self.admit(identity, h, term, step, total)
        elif self.parks:
            self.parked = [*[p for p in self.parked if p[0] != identity], (identity, h)][-PARKED:]
        else:  # the leader has not told us the run's fingerprint yet (it does before its first welcome)
            self.send(identity, "reject", fatal=False, reason=f"shard {self.shard} has not joined its leader's term "
                      "yet; say hello again")

    def opened(self, fp: dict[str, Any], term: int, step: int, total: int) -> None:
        """The leader's welcome came (its fingerprint): the parked hellos are answered."""
        self.fp = fp
        parked, self.parked = self.parked, []
        for identity, h in parked:
            self.admit(identity, h, term, step, total)

    def new_term(self, term: int) -> None:
        """Joined a new term in place: hellos wait for its leader's welcome, and the old term's workers are told to
        say hello again, then forgotten (what they send on the old term's connections: `unknown_worker`). Told: a
        worker waiting here for a slice of the old term's step would otherwise wait out its shard timeout (10 s in
        bench/recovery_log.py's shard kills that fell back to a new term), since this shard's address, which it
        watches, did not change."""
        self.fp, self.parks, self.parked = None, True, []
        for identity in self.admission.workers:
            self.send(identity, "reject", fatal=False, reason=f"term {term} started: say hello again")
        self.admission.workers.clear()
        self.intake.keep(self.admission.workers)

    def admit(self, identity: bytes, h: dict[str, Any], term: int, step: int, total: int) -> None:
        if (info := self.admission.hello(identity, h)) is not None:
            self.send(identity, "welcome", term=term, step=step, version=step, total_steps=total,
                      shm=self.intake.grant(identity, h))
            self.log.info("worker admitted", worker=info.wid, incarnation=info.inc, host=info.host)
