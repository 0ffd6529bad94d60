"""Slots (`--supervise local`): one child process per service slot, and the warm spares that refill worker slots.

A slot keeps its identity (`worker:w1`) across processes: a dead worker's slot goes to a warm spare (already
imported and loaded) when one is alive, else to a new process after a backoff; a process that keeps dying is
given up on after cluster.max_restarts. RUN_DIR/children.json records every running process (pid, command
line, spare or not) at once when it changes, so that a restarted coordinator adopts them instead of starting a
second copy (supervisor.py: `load_children` checks the command line, so a reused pid is never adopted).
"""

from __future__ import annotations

import signal
import time
from typing import cast

import redis
from cmemi.services.coordinator.run_state import RunState
from cmemi.services.coordinator.supervisor import (
    HEALTHY_AFTER_S,
    Child,
    SlotState,
    backoff,
    read_children,
    save_children,
    service_argv,
)
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.runtime import metrics
from cmemi.shared.runtime.service import ServiceContext


class Slots:
    def __init__(self, ctx: ServiceContext, config_path: str, run: RunState) -> None:
        self.ctx, self.cfg, self.log, self.run = ctx, ctx.cfg, ctx.log, run
        self.config_path = config_path  # children find Redis through the inherited CMEMI_REDIS_URL
        self.children: dict[str, Child] = {}  # "role:id" -> the slot's current process
        self.spares: list[Child] = []
        self.spare_seq = 0
        self.spare_failures = 0  # spares that died in a row without taking a slot
        self.deferred = False  # a fresh run starts its spares only once the first step is done
        self.target_workers = self.cfg.cluster.workers
        self.file = ctx.run_dir / "children.json"  # what a restarted coordinator adopts
        self.saved: list[tuple[str, int | None]] = []

    def everyone(self) -> list[Child]:
        return [*self.children.values(), *self.spares]

    def argv(self, role: str, ident: str) -> list[str]:
        extra = (["--worker-id", ident] if role == "worker" else
                 ["--shard", ident] if role == "aggregator" and ident != "0" else [])
        return service_argv(role, self.config_path, *extra)

    def adopt_or_start(self) -> None:
        """Adopt the services an earlier coordinator of this run started (they outlive it under `cmemi up`),
        then start whatever is missing. Nothing healthy is restarted. A fresh run starts its spares only once
        the first step is done (`start_spares`)."""
        slots = registered_workers(self.ctx.redis, self.ctx.keys)
        adopted, gone = read_children(self.file)
        for child in gone:  # exited while no coordinator watched: the loop reads its exit first (`died` once)
            if not child.spare:
                self.children[child.name] = child
        for child in adopted:
            if child.spare:
                self.spare_seq = max(self.spare_seq, int(child.ident[5:] or 0) if child.ident[5:].isdigit() else 0)
                if child.pid is not None and (slot := slots.get(child.pid)) is not None and f"worker:{slot}" not in self.children:
                    # handed a slot just before the previous coordinator died (children.json still said spare)
                    child.ident, child.spare, child.argv = slot, False, self.argv("worker", slot)
            if child.spare:
                self.spares.append(child)
            else:
                self.children[child.name] = child
            self.ctx.emit("process_adopted", role=child.role, id=child.ident, pid=child.pid)
            self.log.info("adopted running process", process=child.name, pid=child.pid)
        for role, ident in (("checkpointer", "0"), *(("aggregator", str(k)) for k in range(self.cfg.cluster.shards)),
                            *(("worker", f"w{i}") for i in range(self.target_workers))):
            if f"{role}:{ident}" in self.children:
                continue
            if role == "worker" and adopted:  # its process died while no coordinator ran: a warm spare first
                child = Child(role, ident, self.argv(role, ident))
                self.children[child.name] = child
                self.replace(child, died=False)
            else:
                self.add(role, ident)
        if adopted:
            self.start_spares()
        else:
            self.deferred = True
        self.save()

    def start_spares(self) -> None:
        """Start the warm spares. On a fresh run, not before the first step is done: until then they would compete
        for the CPU with the processes the first step waits for (building the model and the dataset, the first
        microbatches), and a worker that dies before it is replaced by a fresh process."""
        self.deferred = False
        for _ in range(self.cfg.cluster.spare_workers - len(self.spares)):
            self.add_spare()
        self.save()  # at once: a coordinator killed now must leave them to its successor

    def save(self) -> None:
        """Rewrite children.json when a process started, exited or changed slot (not at every scan)."""
        everyone = self.everyone()
        now = sorted((c.name + ("/spare" if c.spare else ""), c.pid if c.alive else None) for c in everyone)
        if now != self.saved:
            save_children(self.file, everyone)
            self.saved = now

    def add(self, role: str, ident: str) -> Child:
        child = Child(role, ident, self.argv(role, ident))
        self.children[child.name] = child
        child.start()
        self.ctx.emit("process_started", role=role, id=ident, pid=child.pid)
        return child

    def add_spare(self) -> None:
        self.spare_seq += 1
        ident = f"spare{self.spare_seq}"
        child = Child("worker", ident, service_argv("worker", self.config_path, "--spare", ident), spare=True)
        child.start()
        self.spares.append(child)

    def dismiss_spares(self) -> None:
        """The run is over: wake every warm spare out of its wait with an empty id (it exits) and SIGTERM it, so
        that the spares shut down while the aggregator finishes, not after it."""
        for spare in self.spares:
            if spare.alive and not spare.dismissed:
                spare.dismissed = True
                self.ctx.redis.rpush(self.ctx.keys.spare(spare.ident), "")
                spare.signal(signal.SIGTERM)

    def replace(self, child: Child, died: bool = True) -> None:
        """Restart a dead child (or fill an empty worker slot, `died=False`): a warm spare takes a worker's
        identity at once; otherwise a new process (`restart_if_due`). A crash loop fails the run, unless it is a
        worker and another worker is still alive (training goes on with fewer)."""
        child.forget()
        if time.monotonic() - child.started_at >= HEALTHY_AFTER_S or self._trained(child):
            child.restarts = 0  # it had been running fine: a new fault, not a crash loop
        child.restarts += died
        if child.restarts > self.cfg.cluster.max_restarts:
            if child.slot is SlotState.ACTIVE:  # (a retired slot stays retired)
                child.slot = SlotState.GIVEN_UP
            msg = (f"{child.name} died {child.restarts} times; not restarting it again "
                   f"(cluster.max_restarts={self.cfg.cluster.max_restarts}); see its log for the cause")
            self.log.error("giving up on process", process=child.name)
            self.ctx.emit("gave_up", role=child.role, id=child.ident, restarts=child.restarts - 1)
            if child.role != "worker" or not any(c.alive for c in self.children.values() if c.role == "worker"):
                self.run.fail(msg)
            return
        if child.role == "worker" and self._hand_to_spare(child):
            return
        child.next_start = time.monotonic() + (backoff(child.restarts) if died else 0.0)

    def _hand_to_spare(self, child: Child) -> bool:
        spare = next((s for s in self.spares if s.alive), None)
        if spare is None:
            return False
        try:
            self.ctx.redis.rpush(self.ctx.keys.spare(spare.ident), child.ident)
        except redis.RedisError:
            return False  # Redis is down: the spare cannot be told; start a new process instead
        self.spares.remove(spare)
        spare.ident, spare.restarts, spare.role, spare.spare = child.ident, child.restarts, "worker", False
        spare.argv = list(child.argv)  # if it dies in turn, this slot restarts as a normal worker
        spare.started_at = time.monotonic()  # its life as this worker starts now
        spare.registered = False
        self.children[child.name] = spare
        metrics.RESTARTS.labels("worker").inc()
        self.ctx.emit("restarted", role="worker", id=child.ident, via="spare", pid=spare.pid)
        self.add_spare()
        self.save()  # at once: a coordinator dying now must not adopt it as a spare
        return True

    def restart_if_due(self, child: Child, now: float) -> None:
        """Start a new process in an empty slot once its backoff is over."""
        if child.slot is SlotState.ACTIVE and now >= child.next_start:
            child.start()
            child.progress_at_start = self._progress() if child.role == "aggregator" else None
            metrics.RESTARTS.labels(child.role).inc()
            self.ctx.emit("restarted", role=child.role, id=child.ident, via="new_process", pid=child.pid)

    def _progress(self) -> int | None:
        try:
            step = self.ctx.redis.hget(self.ctx.keys.progress, "step")
        except redis.RedisError:
            return None
        return int(step) if step is not None else None

    def _trained(self, child: Child) -> bool:
        """Did this leader process move the run's progress on since it was restarted? Then it was healthy, however
        short its life: its death is a new fault, restarted without a crash loop's backoff. A second leader kill
        within HEALTHY_AFTER_S waited 0.5 s for nothing (bench/recovery.py --parts steplog: about a third of the
        kill-to-next-step time). A leader that dies before training a step is still backed off. The same for a
        shard k > 0: no step commits without every shard, so the run's progress moved on only with this one in it
        (its second and third kills within a minute waited 0.5 s and 1.0 s before the restart, issue 47)."""
        if child.progress_at_start is None:
            return False
        now = self._progress()
        return now is not None and now > child.progress_at_start

    def next_restart(self, until: float) -> float:
        """The earlier of `until` and the next pending restart (the coordinator wakes up for it)."""
        for c in self.children.values():
            if not c.running and c.slot is SlotState.ACTIVE:
                until = min(until, c.next_start)
        return until

    def replace_spare(self, died: bool) -> None:
        """A spare exited before the run ended: start another, unless spares keep dying without ever taking a
        slot (a crash loop: the worker slots are still kept, they restart as new processes)."""
        self.spare_failures += died
        if self.spare_failures <= self.cfg.cluster.max_restarts:
            self.add_spare()
        elif self.spare_failures == self.cfg.cluster.max_restarts + 1:
            self.ctx.emit("gave_up", role="worker", id="spares", restarts=self.spare_failures - 1)
            self.log.error("spare workers keep dying; not starting more (the worker slots are still kept)")

    def scale(self, want: int) -> None:
        """`cmemi scale N`: the highest-numbered workers leave gracefully (SIGTERM: they return their leases)
        and new slots take the lowest free ids."""
        want = max(1, want)
        if want == self.target_workers:
            return
        self.target_workers = want
        workers = sorted((c for c in self.children.values() if c.role == "worker" and c.slot is not SlotState.RETIRED),
                         key=lambda c: int(c.ident[1:]) if c.ident[1:].isdigit() else 0)
        for c in workers[self.target_workers:]:
            c.slot = SlotState.RETIRED
            c.signal(signal.SIGTERM)
        used = {c.ident for c in self.children.values()}
        i = 0
        while sum(1 for c in self.children.values()
                  if c.role == "worker" and c.slot is not SlotState.RETIRED) < self.target_workers:
            while f"w{i}" in used:
                i += 1
            self.add("worker", f"w{i}")
            used.add(f"w{i}")
        self.ctx.emit("scaled", workers=self.target_workers)


def registered_workers(client: redis.Redis, keys: Keys) -> dict[int, str]:
    """pid -> worker id of the worker records in Redis that are running (empty when Redis is down)."""
    try:  # (the client decodes every reply: shared/coordination/membership.py, `text`)
        records = [cast("dict[str, str]", client.hgetall(key))
                   for key in client.scan_iter(match=keys.member("worker", "*"), count=500)]
    except redis.RedisError:
        return {}
    return {int(rec["pid"]): rec["id"] for rec in records
            if rec.get("state") == "running" and rec.get("pid", "").isdigit() and "id" in rec}
