"""Membership and liveness: detect deaths (exit or missing heartbeat), fence, free leases, restart.

Two modes (`--supervise`):
- `local`: the coordinator starts every service as a child process and restarts what dies,
  handing a dead worker's identity to a warm spare (already imported and loaded) when it has one.
- `none`: an orchestrator (compose, Kubernetes) restarts processes; the coordinator still detects,
  fences and frees leases, and the restarted process re-registers by itself.

This module is the loop; each job it runs lives beside it: `slots` (children and spares), `liveness`
(heartbeats and start deadlines), `fencing` (declaring a death), `run_state` (the run's state and
`cmemi scale`), `events_log` (RUN_DIR/events.jsonl), `child_exit` (how an exit is read), `supervisor`
(one child process).
"""

from __future__ import annotations

import time

import redis
from cmemi.services.coordinator.child_exit import ExitKind, exit_kind
from cmemi.services.coordinator.events_log import EventsLog
from cmemi.services.coordinator.fencing import Fencer
from cmemi.services.coordinator.liveness import Death, Liveness
from cmemi.services.coordinator.run_state import RunPhase, RunState, Supervise
from cmemi.services.coordinator.slots import Slots
from cmemi.services.coordinator.supervisor import Child, SlotState, stop_all, wait_for_exit
from cmemi.shared.coordination.counters import GAP, Counters
from cmemi.shared.coordination.membership import Member, text
from cmemi.shared.runtime import startup
from cmemi.shared.runtime.exits import Exit
from cmemi.shared.runtime.service import ServiceContext

REDIS_RETRY_S = 0.2  # while Redis is down, nothing is retried faster than this


class Coordinator:
    def __init__(self, ctx: ServiceContext, supervise: Supervise, config_path: str) -> None:
        self.ctx, self.cfg, self.log = ctx, ctx.cfg, ctx.log
        self.supervise = supervise
        self.local = supervise is Supervise.LOCAL
        self.counters = Counters(ctx.run_dir / "counters.json", ctx.redis, ctx.keys)
        self.counters.check()  # before our own incarnation is drawn
        self.member = Member(ctx.redis, ctx.keys, "coordinator", "0", self.cfg.cluster.heartbeat_interval,
                             self.cfg.cluster.dead_after, extra=ctx.member_extra).start()
        self.run_state = RunState(ctx)
        self.slots = Slots(ctx, config_path, self.run_state)  # stays empty unless local
        self.fencer = Fencer(ctx)
        self.liveness = Liveness(ctx, self.fencer)
        self.events = EventsLog(ctx.redis, ctx.keys, ctx.run_dir / "events.jsonl")
        self._redis_down_since: float | None = None

    def run(self) -> int:
        if not self.run_state.open():  # a restarted coordinator must not start a completed run's services again
            self.log.info("the run has completed already; nothing to supervise")  # (whoever started us stops any)
            return 0
        self.ctx.emit("coordinator_started", supervise=self.supervise.value, workers=self.slots.target_workers)
        if self.local:
            self.slots.adopt_or_start()
            startup.mark("services_spawned")
        startup.report(self.ctx.redis, self.ctx.keys, "coordinator", "0")
        next_scan = 0.0
        while self.run_state.exit_code is None:
            if self.ctx.stopping.is_set():
                self.log.info("stopping on signal")
                self.run_state.exit_code = 130
                break
            try:
                if self.local:
                    self._check_children()
                now = time.monotonic()
                if now >= next_scan and self.run_state.exit_code is None:
                    next_scan = now + self.cfg.cluster.heartbeat_interval / 2
                    self._scan()
                if self._redis_down_since is not None:
                    self.log.info("redis is back", down_s=round(time.monotonic() - self._redis_down_since, 2))
                    self._redis_down_since = None
            except redis.RedisError as exc:  # Redis down or restarting: keep supervising, retry shortly
                if self._redis_down_since is None:  # one line per outage, not one per attempt
                    self._redis_down_since = time.monotonic()
                    self.log.warning("redis unavailable; retrying every 0.2 s", error=str(exc))
                next_scan = time.monotonic() + REDIS_RETRY_S
            if self.local:
                self.slots.save()
            self._wait(next_scan, floor=REDIS_RETRY_S if self._redis_down_since is not None else 0.0)
        return self.run_state.exit_code

    def _scan(self) -> None:
        """Every half heartbeat interval: events to disk, counters, fences, heartbeats, run state."""
        self.events.tail()
        self._start_spares_after_first_step()
        if restored := self.counters.check():
            self.ctx.emit("counters_restored", keys=restored, gap=GAP)
            self.log.warning("redis lost counters; moved them past the highest known", keys=restored)
        self.fencer.retry()
        for death in self.liveness.scan(self.slots.children, self.local):
            self._bury(death)
        self._check_control()

    def _wait(self, until: float, floor: float = 0.0) -> None:
        """Sleep until `until`, a child's exit, or a pending restart's time, whichever comes first
        (but at least `floor` seconds: while Redis is down nothing is retried faster than that)."""
        if self.local:
            until = max(self.slots.next_restart(until), time.monotonic() + floor)
            wait_for_exit(self.slots.everyone(), until - time.monotonic())
        else:
            time.sleep(max(0.0, until - time.monotonic()))

    def close(self) -> None:
        stop_all(self.slots.everyone(), grace=5.0)
        if self.local:
            self.slots.file.unlink(missing_ok=True)
        self.events.close()
        self.member.stop()
        self.fencer.close()

    def _bury(self, death: Death) -> None:
        """Fence a dead process and, when it is ours, refill its slot."""
        self.fencer.declare_dead(death.role, death.ident, how=death.how, pid=death.pid, inc=death.inc)
        if death.child is not None:
            self.slots.replace(death.child)

    def _check_children(self) -> None:
        now = time.monotonic()
        children = self.slots.children
        for child in list(children.values()):
            if not child.running:
                self.slots.restart_if_due(child, now)
                continue
            rc = child.poll()
            if rc is None:
                continue
            if child.slot is SlotState.RETIRED:
                child.forget()
                del children[child.name]
                continue
            kind = self._exit_kind(child, rc)
            if kind is ExitKind.FATAL:
                self.run_state.fail(text(self.ctx.redis.get(self.ctx.keys.error)) or f"{child.name} exited with a fatal error")
                return
            if kind is ExitKind.NORMAL and self.run_state.completed():
                child.forget()
                child.slot = SlotState.RETIRED  # finished its part of a completed run
                continue
            if kind is ExitKind.NORMAL:  # left on its own before the end (e.g. told to stop): not a death, restart
                self.ctx.emit("exited", role=child.role, id=child.ident, pid=child.pid)
                child.forget()
                child.next_start = now
                continue
            self._bury(Death(child.role, child.ident, f"exit code {rc}" if rc != Exit.UNKNOWN else "exited",
                             child.pid, None, child))
        self._check_spares()

    def _check_spares(self) -> None:
        for spare in list(self.slots.spares):
            rc = spare.poll()
            if rc is None:
                continue
            self.slots.spares.remove(spare)
            kind = self._exit_kind(spare, rc)
            spare.forget()
            if kind is ExitKind.FATAL:
                self.run_state.fail(text(self.ctx.redis.get(self.ctx.keys.error)) or "a spare worker hit a fatal error")
                return
            if not self.run_state.completed():
                self.slots.replace_spare(died=kind is ExitKind.DIED)

    def _exit_kind(self, child: Child, rc: int) -> ExitKind:
        return exit_kind(child, rc, self.ctx.redis, self.ctx.keys)

    def _check_control(self) -> None:
        """The run completed or failed, a service's fatal error, `cmemi scale`: one round trip."""
        control = self.run_state.control()
        if control.phase is RunPhase.COMPLETED:
            self.slots.dismiss_spares()
            agg = self.slots.children.get("aggregator:0")
            if agg is None or not agg.alive or not self.local:
                self.run_state.exit_code = 0
        elif control.phase is RunPhase.FAILED:
            self.run_state.exit_code = 1
        elif control.phase is not None and not self.local and control.error:
            self.run_state.fail(control.error)  # a service hit a fatal (user-fixable) error: restarting will not help
        if self.local and self.run_state.exit_code is None and control.scale is not None:
            self.slots.scale(int(control.scale))

    def _start_spares_after_first_step(self) -> None:
        """A fresh run's spares wait for the first step (slots.Slots.start_spares says why)."""
        if not self.slots.deferred:
            return
        try:
            if int(self.ctx.redis.hget(self.ctx.keys.progress, "step") or 0) >= 1:
                self.slots.start_spares()
        except (redis.RedisError, ValueError):
            pass
