"""Membership and liveness: detect deaths (exit or missing heartbeat), fence, free leases, restart.

Two modes (`--supervise`):
- `local`: the coordinator starts every service as a child process and restarts what dies,
  handing a dead worker's identity to a warm spare (already imported and loaded) when it has one.
- `none`: an orchestrator (compose, Kubernetes) restarts processes; the coordinator still detects,
  fences and frees leases, and the restarted process re-registers by itself.
"""

from __future__ import annotations

import json
import signal
import time

import redis
import zmq
from cmemi.services.coordinator.supervisor import (
    HEALTHY_AFTER_S,
    Child,
    backoff,
    load_children,
    save_children,
    service_argv,
    stop_all,
    wait_for_exit,
)
from cmemi.shared.coordination.counters import GAP, Counters
from cmemi.shared.coordination.membership import Member, read_events
from cmemi.shared.runtime import metrics, startup
from cmemi.shared.runtime.exits import Exit
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import header as wire
from cmemi.shared.wire import samehost


class Coordinator:
    def __init__(self, ctx: ServiceContext, supervise: str, config_path: str) -> None:
        self.ctx, self.cfg, self.log = ctx, ctx.cfg, ctx.log
        self.supervise = supervise
        self.config_path = config_path  # children find Redis through the inherited CMEMI_REDIS_URL
        self.counters = Counters(ctx.run_dir / "counters.json", ctx.redis, ctx.keys)
        self.counters.check()  # before our own incarnation is drawn
        self.member = Member(ctx.redis, ctx.keys, "coordinator", "0", self.cfg.cluster.heartbeat_interval,
                             self.cfg.cluster.dead_after, extra=ctx.member_extra).start()
        self.children: dict[str, Child] = {}
        self.spares: list[Child] = []
        self._spare_seq = 0
        self._deferred = False  # a fresh run starts its spares only once the first step is done
        self.declared: dict[tuple[str, str], int] = {}  # (role, id) -> newest incarnation declared dead
        self.zctx = zmq.Context()
        self.agg_sock: zmq.Socket | None = None
        self.agg_addr: str | None = None
        self.events_cursor = "0-0"
        self.events_file = open(ctx.run_dir / "events.jsonl", "a", buffering=1)
        self.target_workers = self.cfg.cluster.workers
        self.exit_code: int | None = None
        self.children_file = ctx.run_dir / "children.json"  # what a restarted coordinator adopts
        self._saved_children: list[tuple[str, int | None]] = []
        self.spare_failures = 0  # spares that died in a row without taking a slot
        self.pending_fences: dict[tuple[str, str], int] = {}  # fences Redis could not take yet
        self._redis_down_since: float | None = None

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        r, k = self.ctx.redis, self.ctx.keys
        r.set(k.state, "running", nx=True)  # a restarted coordinator must not reopen a finished run
        if r.get(k.state) == "completed":  # nor start its services again (whoever started us stops any left over)
            self.log.info("the run has completed already; nothing to supervise")
            return 0
        self.ctx.emit("coordinator_started", supervise=self.supervise, workers=self.target_workers)
        if self.supervise == "local":
            self._adopt_or_start()
            startup.mark("services_spawned")
        else:
            self._after_start_up()
        startup.report(r, k, "coordinator", "0")
        next_scan = 0.0
        while self.exit_code is None:
            if self.ctx.stopping.is_set():
                self.log.info("stopping on signal")
                self.exit_code = 130
                break
            try:
                if self.supervise == "local":
                    self._check_children()
                now = time.monotonic()
                if now >= next_scan and self.exit_code is None:
                    next_scan = now + self.cfg.cluster.heartbeat_interval / 2
                    self._tail_events()
                    if restored := self.counters.check():
                        self.ctx.emit("counters_restored", keys=restored, gap=GAP)
                        self.log.warning("redis lost counters; moved them past the highest known", keys=restored)
                    self._retry_fences()
                    self._check_heartbeats()
                    self._check_control()
                if self._redis_down_since is not None:
                    self.log.info("redis is back", down_s=round(time.monotonic() - self._redis_down_since, 2))
                    self._redis_down_since = None
            except redis.RedisError as exc:  # Redis down or restarting: keep supervising, retry shortly
                if self._redis_down_since is None:  # one line per outage, not one per attempt
                    self._redis_down_since = time.monotonic()
                    self.log.warning("redis unavailable; retrying every 0.2 s", error=str(exc))
                next_scan = time.monotonic() + 0.2
            if self.supervise == "local":
                self._save_children()
            self._wait(next_scan, floor=0.2 if self._redis_down_since is not None else 0.0)
        return self.exit_code

    def _wait(self, until: float, floor: float = 0.0) -> None:
        """Sleep until `until`, a child's exit, or a pending restart's time, whichever comes first
        (but at least `floor` seconds: while Redis is down nothing is retried faster than that)."""
        if self.supervise == "local":
            for c in self.children.values():
                if not c.running and c.wanted and not c.given_up:
                    until = min(until, c.next_start)
            until = max(until, time.monotonic() + floor)
            wait_for_exit([*self.children.values(), *self.spares], until - time.monotonic())
        else:
            time.sleep(max(0.0, until - time.monotonic()))

    def close(self) -> None:
        stop_all(list(self.children.values()) + self.spares, grace=5.0)
        if self.supervise == "local":
            self.children_file.unlink(missing_ok=True)
        self._tail_events()
        self.events_file.close()
        self.member.stop()
        if self.agg_sock is not None:
            self.agg_sock.close(linger=0)
        self.zctx.destroy(linger=200)

    # ------------------------------------------------------------------ children
    def _argv(self, role: str, ident: str) -> list[str]:
        extra = (["--worker-id", ident] if role == "worker" else
                 ["--shard", ident] if role == "aggregator" and ident != "0" else [])
        return service_argv(role, self.config_path, *extra)

    def _adopt_or_start(self) -> None:
        """Adopt the services an earlier coordinator of this run started (they outlive it under `cmemi up`),
        then start whatever is missing. Nothing healthy is restarted. A fresh run does what only later needs
        once the first step is done (_after_start_up)."""
        slots = self._registered_workers()
        adopted = load_children(self.children_file)
        for child in adopted:
            if child.spare:
                self._spare_seq = max(self._spare_seq, int(child.ident[5:] or 0) if child.ident[5:].isdigit() else 0)
                if (slot := slots.get(child.pid)) is not None and f"worker:{slot}" not in self.children:
                    # handed a slot just before the previous coordinator died (children.json still said spare)
                    child.ident, child.spare, child.argv = slot, False, self._argv("worker", slot)
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
                child = Child(role, ident, self._argv(role, ident))
                self.children[child.name] = child
                self._replace(child, died=False)
            else:
                self._add(role, ident)
        if adopted:
            self._after_start_up()
        else:
            self._deferred = True
        self._save_children()

    def _after_start_up(self) -> None:
        """Start the warm spares. On a fresh run, not before the first step is done: until then they would compete
        for the CPU with the processes the first step waits for (building the model and the dataset, the first
        microbatches), and a worker that dies before it is replaced by a fresh process."""
        self._deferred = False
        if self.supervise == "local":
            for _ in range(self.cfg.cluster.spare_workers - len(self.spares)):
                self._add_spare()
            self._save_children()  # at once: a coordinator killed now must leave them to its successor

    def _save_children(self) -> None:
        everyone = [*self.children.values(), *self.spares]
        now = sorted((c.name + ("/spare" if c.spare else ""), c.pid if c.alive else None) for c in everyone)
        if now != self._saved_children:
            save_children(self.children_file, everyone)
            self._saved_children = now

    def _add(self, role: str, ident: str) -> Child:
        child = Child(role, ident, self._argv(role, ident))
        self.children[child.name] = child
        child.start()
        self.ctx.emit("process_started", role=role, id=ident, pid=child.pid)
        return child

    def _add_spare(self) -> None:
        self._spare_seq += 1
        ident = f"spare{self._spare_seq}"
        child = Child("worker", ident, service_argv("worker", self.config_path, "--spare", ident),
                      spare=True)
        child.start()
        self.spares.append(child)

    def _dismiss_spares(self) -> None:
        """The run is over: wake every warm spare out of its wait with an empty id (it exits) and SIGTERM it, so
        that the spares shut down while the aggregator finishes, not after it."""
        for spare in self.spares:
            if spare.alive and not spare.dismissed:
                spare.dismissed = True
                self.ctx.redis.rpush(self.ctx.keys.spare(spare.ident), "")
                spare.signal(signal.SIGTERM)

    def _registered_workers(self) -> dict[int, str]:
        """pid -> worker id of the worker records in Redis that are running (empty when Redis is down)."""
        r, k = self.ctx.redis, self.ctx.keys
        try:
            records = [r.hgetall(key) for key in r.scan_iter(match=k.member("worker", "*"), count=500)]
        except redis.RedisError:
            return {}
        return {int(rec["pid"]): rec["id"] for rec in records
                if rec.get("state") == "running" and rec.get("pid", "").isdigit() and "id" in rec}

    def _replace(self, child: Child, died: bool = True) -> None:
        """Restart a dead child (or fill an empty worker slot, `died=False`): a warm spare takes a worker's
        identity at once; otherwise a new process."""
        child.forget()
        if time.monotonic() - child.started_at >= HEALTHY_AFTER_S:
            child.restarts = 0  # it had been running fine: a new fault, not a crash loop
        child.restarts += died
        if child.restarts > self.cfg.cluster.max_restarts:
            child.given_up = True
            msg = (f"{child.name} died {child.restarts} times; not restarting it again "
                   f"(cluster.max_restarts={self.cfg.cluster.max_restarts}); see its log for the cause")
            self.log.error("giving up on process", process=child.name)
            self.ctx.emit("gave_up", role=child.role, id=child.ident, restarts=child.restarts - 1)
            if child.role != "worker" or not any(c.alive for c in self.children.values() if c.role == "worker"):
                self._fail(msg)
            return
        if child.role == "worker":
            spare = next((s for s in self.spares if s.alive), None)
            if spare is not None:
                try:
                    self.ctx.redis.rpush(self.ctx.keys.spare(spare.ident), child.ident)
                except redis.RedisError:
                    spare = None  # Redis is down: the spare cannot be told; start a new process instead
            if spare is not None:
                self.spares.remove(spare)
                spare.ident, spare.restarts, spare.role, spare.spare = child.ident, child.restarts, "worker", False
                spare.argv = list(child.argv)  # if it dies in turn, this slot restarts as a normal worker
                spare.started_at = time.monotonic()  # its life as this worker starts now
                spare.registered = False
                self.children[child.name] = spare
                metrics.RESTARTS.labels("worker").inc()
                self.ctx.emit("restarted", role="worker", id=child.ident, via="spare", pid=spare.pid)
                self._add_spare()
                self._save_children()  # at once: a coordinator dying now must not adopt it as a spare
                return
        child.next_start = time.monotonic() + (backoff(child.restarts) if died else 0.0)

    def _exit_kind(self, child: Child, rc: int) -> str:
        """How a child ended: "fatal" (a user error), "normal" (exit 0, or its record says stopped) or "died".
        An adopted process's exit code cannot be read: its own Redis record and the run's error decide."""
        if rc == Exit.FATAL:
            return "fatal"
        if rc in (0, Exit.REJOIN):  # Exit.REJOIN: a shard left a term that went back to a checkpoint
            return "normal"
        if rc == Exit.UNKNOWN:
            r, k = self.ctx.redis, self.ctx.keys
            record, error = r.hgetall(k.member(child.role, child.ident)), r.get(k.error)
            if error:
                return "fatal"
            if record.get("pid") == str(child.pid) and record.get("state") == "stopped":
                return "normal"
        return "died"

    def _check_children(self) -> None:
        now = time.monotonic()
        for child in list(self.children.values()):
            if not child.running:
                if child.wanted and not child.given_up and now >= child.next_start:
                    child.start()
                    metrics.RESTARTS.labels(child.role).inc()
                    self.ctx.emit("restarted", role=child.role, id=child.ident, via="new_process", pid=child.pid)
                continue
            rc = child.poll()
            if rc is None:
                continue
            if not child.wanted:
                child.forget()
                del self.children[child.name]
                continue
            kind = self._exit_kind(child, rc)
            if kind == "fatal":
                self._fail(self.ctx.redis.get(self.ctx.keys.error) or f"{child.name} exited with a fatal error")
                return
            if kind == "normal" and self._completed():
                child.forget()
                child.wanted = False  # finished its part of a completed run
                continue
            if kind == "normal":  # left on its own before the end (e.g. told to stop): not a death, restart
                self.ctx.emit("exited", role=child.role, id=child.ident, pid=child.pid)
                child.forget()
                child.next_start = now
                continue
            self._declare_dead(child.role, child.ident, how=f"exit code {rc}" if rc != Exit.UNKNOWN else "exited",
                               pid=child.pid)
            self._replace(child)
        for spare in list(self.spares):
            rc = spare.poll()
            if rc is None:
                continue
            self.spares.remove(spare)
            kind = self._exit_kind(spare, rc)
            spare.forget()
            if kind == "fatal":
                self._fail(self.ctx.redis.get(self.ctx.keys.error) or "a spare worker hit a fatal error")
                return
            if self._completed():
                continue
            # a dead spare is replaced, unless spares keep dying without ever taking a slot (a crash loop)
            self.spare_failures += kind == "died"
            if self.spare_failures <= self.cfg.cluster.max_restarts:
                self._add_spare()
            elif self.spare_failures == self.cfg.cluster.max_restarts + 1:
                self.ctx.emit("gave_up", role="worker", id="spares", restarts=self.spare_failures - 1)
                self.log.error("spare workers keep dying; not starting more (the worker slots are still kept)")

    # ------------------------------------------------------------------ liveness
    def _check_heartbeats(self) -> None:
        r, k = self.ctx.redis, self.ctx.keys
        # A RedisError goes to run(), which says so once per outage and retries every 0.2 s.
        member_prefix = k.member("", "")[:-1]  # ...:member:
        members = [(key, *key[len(member_prefix):].partition(":")[::2])
                   for key in r.scan_iter(match=k.member("*", "*"), count=500)]
        # First only whose heartbeat is missing (one pipelined EXISTS each: a healthy cluster costs no more);
        # a local child that has not registered yet needs every record (its pid), for its start deadline.
        starting = self.supervise == "local" and any(not c.registered and c.alive for c in self.children.values())
        if not starting:
            pipe = r.pipeline(transaction=False)
            for _key, role, ident in members:
                pipe.exists(k.heartbeat(role, ident))
            members = [m for m, beating in zip(members, pipe.execute(), strict=True) if not beating]
            if not members:
                return
        # Each record and its heartbeat in one MULTI/EXEC: a graceful exit marks the record stopped and
        # deletes the heartbeat atomically, so it is never seen half done (running, without a heartbeat).
        pipe = r.pipeline(transaction=True)
        for key, role, ident in members:
            pipe.hgetall(key)
            pipe.exists(k.heartbeat(role, ident))
        replies = pipe.execute()
        if starting:
            self._check_start_deadlines(replies[::2])
        for record, alive in zip(replies[::2], replies[1::2], strict=True):
            if alive or not record or record.get("role") == "coordinator" or record.get("state") == "stopped":
                continue
            role, ident, inc, pid = record["role"], record["id"], int(record["incarnation"]), int(record.get("pid", 0))
            if self.declared.get((role, ident), 0) >= inc:
                continue
            if int(r.get(k.fence(role, ident)) or 0) >= inc:  # declared by an earlier coordinator
                self.declared[(role, ident)] = inc
                continue
            if time.time() - float(record.get("started_at", 0)) < self.cfg.cluster.dead_after:
                continue
            child = self.children.get(f"{role}:{ident}")
            if child is not None and child.pid == pid and child.alive:
                child.kill()  # alive but silent: hung (or stopped); kill it, do not wait on it
                self._declare_dead(role, ident, how="heartbeat missing (hung)", pid=pid, inc=inc)
                self._replace(child)
            elif child is None or child.pid != pid:
                # not ours to restart (another host / orchestrator): detect, fence, re-admit later
                self._declare_dead(role, ident, how="heartbeat missing", pid=pid, inc=inc)

    def _check_start_deadlines(self, records: list[dict[str, str]]) -> None:
        """A started process must register (a member record with its pid) within cluster.start_timeout."""
        pids = {(rec.get("role"), rec.get("id")): rec.get("pid") for rec in records if rec}
        now = time.monotonic()
        for child in list(self.children.values()):
            if child.registered or not child.alive:
                continue
            if pids.get((child.role, child.ident)) == str(child.pid):
                child.registered = True
            elif now - child.started_at > self.cfg.cluster.start_timeout:
                pid = child.pid
                child.kill()
                self._declare_dead(child.role, child.ident, pid=pid, how=f"did not register within "
                                   f"cluster.start_timeout={self.cfg.cluster.start_timeout:g}s (hung at start)")
                self._replace(child)

    def _declare_dead(self, role: str, ident: str, how: str, pid: int | None, inc: int | None = None) -> None:
        r, k = self.ctx.redis, self.ctx.keys
        if inc is None:
            try:
                record = r.hgetall(k.member(role, ident))
            except redis.RedisError:
                record = {}  # Redis is down: restart now; the aggregator fences the old incarnation on the new hello
            if record and int(record.get("pid", -1)) == pid:
                inc = int(record["incarnation"])
        metrics.DEATHS.labels(role).inc()
        self.ctx.emit("died", role=role, id=ident, incarnation=inc, how=how, pid=pid)
        self.log.warning("process died", role=role, id=ident, incarnation=inc, how=how)
        if inc is None:
            return  # died before registering: nothing to fence
        self.declared[(role, ident)] = inc
        self.pending_fences[(role, ident)] = inc
        try:
            self._retry_fences()
        except redis.RedisError:
            pass  # retried at every scan until Redis answers

    def _retry_fences(self) -> None:
        r, k = self.ctx.redis, self.ctx.keys
        for (role, ident), inc in list(self.pending_fences.items()):
            r.set(k.fence(role, ident), inc)
            del self.pending_fences[(role, ident)]
            self.ctx.emit("fenced", role=role, id=ident, incarnation=inc)
            if role == "worker":
                self._tell_aggregator_fence(ident, inc)

    def _tell_aggregator_fence(self, wid: str, inc: int) -> None:
        addr = self.ctx.redis.hget(self.ctx.keys.aggregator, "addr")
        if addr is None:
            return
        if addr != self.agg_addr:
            if self.agg_sock is not None:
                self.agg_sock.close(linger=0)
            self.agg_sock = self.zctx.socket(zmq.DEALER)
            self.ctx.curve.connect_as_client(self.agg_sock)
            self.agg_sock.setsockopt(zmq.LINGER, 0)
            self.agg_sock.connect(samehost.tcp_of(addr))  # fences: CurveZMQ always (only workers use ipc://)
            self.agg_addr = addr
        assert self.agg_sock is not None
        # header-only (shared/wire/header.py): the coordinator never imports torch, so a restarted one is up in ~1 s
        self.agg_sock.send(wire.header_only("fence", self.ctx.run, {"wid": wid, "inc": inc}))

    # ------------------------------------------------------------------ run state, scale, events
    def _completed(self) -> bool:
        return self.ctx.redis.get(self.ctx.keys.state) == "completed"

    def _check_control(self) -> None:
        """Run state, fatal errors and the requested worker count: one round trip."""
        k = self.ctx.keys
        state, error, scale = self.ctx.redis.mget(k.state, k.error, k.scale)
        if state is None:  # Redis restarted empty: the run is still running
            self.ctx.redis.set(k.state, "running")
        elif state == "completed":
            self._dismiss_spares()
            agg = self.children.get("aggregator:0")
            if agg is None or not agg.alive or self.supervise == "none":
                self.exit_code = 0
        elif state == "failed":
            self.exit_code = 1
        elif self.supervise == "none" and error:
            self._fail(error)  # a service hit a fatal (user-fixable) error: restarting it will not help
        if self.supervise == "local" and self.exit_code is None and scale is not None:
            self._scale(int(scale))

    def _fail(self, message: str) -> None:
        self.ctx.redis.set(self.ctx.keys.error, message)
        self.ctx.redis.set(self.ctx.keys.state, "failed")
        self.ctx.emit("run_failed", error=message)
        self.log.error("run failed", error=message)
        self.exit_code = 1

    def _scale(self, want: int) -> None:
        want = max(1, want)
        if want == self.target_workers:
            return
        self.target_workers = want
        workers = sorted((c for c in self.children.values() if c.role == "worker" and c.wanted),
                         key=lambda c: int(c.ident[1:]) if c.ident[1:].isdigit() else 0)
        for c in workers[self.target_workers:]:  # graceful leave: SIGTERM -> the worker returns its leases
            c.wanted = False
            c.signal(signal.SIGTERM)
        used = {c.ident for c in self.children.values()}
        i = 0
        while sum(1 for c in self.children.values() if c.role == "worker" and c.wanted) < self.target_workers:
            while f"w{i}" in used:
                i += 1
            self._add("worker", f"w{i}")
            used.add(f"w{i}")
        self.ctx.emit("scaled", workers=self.target_workers)

    def _tail_events(self) -> None:
        try:
            if self.events_cursor != "0-0" and not self.ctx.redis.exists(self.ctx.keys.events):
                self.events_cursor = "0-0"  # Redis lost its data: the stream starts over
            for entry_id, event in read_events(self.ctx.redis, self.ctx.keys, self.events_cursor):
                self.events_cursor = entry_id
                self.events_file.write(json.dumps(event) + "\n")
            if self._deferred and int(self.ctx.redis.hget(self.ctx.keys.progress, "step") or 0) >= 1:
                self._after_start_up()  # the first step is done: the spares no longer compete with it
        except (redis.RedisError, ValueError):
            pass

