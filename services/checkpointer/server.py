"""The checkpointer loop: receive snapshots, write them durably, move the `latest` pointer, enforce retention.

Its memory does not grow with the model: a snapshot's bytes go to disk as they arrive (spool.py), the
checkpoint files are written from there (store.py), and a restore is read back a part at a time
(restore.py). It reads a message a frame at a time, and each sender may have at most one more message
queued in ZeroMQ (RCVHWM; the rest waits on the sender's side): about one part (cluster.message_cap())
per aggregator sending at once."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import redis
import zmq
from cmemi.services.checkpointer import logfiles, restore, spool
from cmemi.services.checkpointer.admission import TermWatch, meta_problem
from cmemi.services.checkpointer.diskfull import DiskFull
from cmemi.services.checkpointer.drops import Drops
from cmemi.services.checkpointer.logfiles import LogFiles
from cmemi.services.checkpointer.logserver import LogServer, reply
from cmemi.services.checkpointer.merge import Merger, merged, sharding_problem
from cmemi.services.checkpointer.spool import Spool, Spooled
from cmemi.services.checkpointer.steplog import StepLog
from cmemi.services.checkpointer.store import CheckpointStore
from cmemi.shared.coordination.membership import Member
from cmemi.shared.coordination.watch import Watch
from cmemi.shared.runtime import atomic, metrics, startup
from cmemi.shared.runtime.links import set_link_options
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits, protocol, transfer


class Checkpointer:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx, self.cfg, self.log = ctx, ctx.cfg, ctx.log
        self.store = CheckpointStore(ctx.run_dir / "checkpoints")
        removed = self.store.clean_leftovers()
        if removed:
            self.log.info("removed leftovers of interrupted writes", leftovers=removed)
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.ROUTER)
        set_link_options(self.sock, self.cfg.cluster)  # a dead link noticed in seconds (shared/runtime/links.py)
        ctx.curve.serve(self.zctx, self.sock)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.cluster.message_cap())
        # a sender's next message waits on its side while one is being read; with ZAP (Curve on) libzmq keeps one
        # entry more in each peer's pipe (RCVHWM 1 then delivers nothing at all), so 2 there queues one message too
        self.sock.setsockopt(zmq.RCVHWM, 2 if self.ctx.curve.enabled else 1)
        self.addr = protocol.bind(self.sock, self.cfg.cluster.host, self.cfg.cluster.checkpointer_port)
        self.member = Member(ctx.redis, ctx.keys, "checkpointer", "0", self.cfg.cluster.heartbeat_interval,
                             self.cfg.cluster.dead_after, extra={"addr": self.addr, **ctx.member_extra}).start()
        self.drops = Drops(ctx.redis, ctx.keys, self.log)
        # snapshots bigger than one message: one partial transfer per aggregator (K of them in a sharded run, sending
        # their slices of a step at once) plus one for a restarted aggregator's new connection
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(self.cfg), self.cfg.cluster.checksum,
                                        peers=self.cfg.cluster.shards + 1, on_abandon=self.drops.count, sink=self._spool)
        self.terms = TermWatch(ctx.redis, ctx.keys)
        # a second restore_req of a (term, shard, process) is not a shard's (a shard k > 0 restarted within its leader's
        # term asks again, from a new process, before the leader rolls everyone back)
        self.restored_terms: set[tuple[int, int, object]] = set()
        self.merger = Merger(spool.discard)  # a sharded run's slices of a step, until all K are in (merge.py)
        self.latest: int | None = None
        self.disk = DiskFull(ctx, self.store, lambda: self.latest)
        self.latest_on_disk()
        # the step log after the newest checkpoint on disk, read back from its segments (logfiles.py; lost with
        # step_log_spool false), served on its own socket and thread (logserver.py): a write never delays a step
        self.steplog, self.steplog_lock = StepLog(self.latest or 0, self.cfg.checkpoint.step_log_memory_mb << 20,
                                                  self._spool_file, self._log_files()), threading.Lock()
        recovered = self.steplog.recover() if self.steplog.files is not None else None
        self.logserver = LogServer(ctx, self.zctx, self.steplog, self.steplog_lock).start()
        self._advertise()
        startup.mark("listening")
        startup.report(ctx.redis, ctx.keys, "checkpointer", "0")
        if recovered is not None:  # after `startup`: netns_checks reads a restart's log as lost until this says not
            self.log.info("step log read back", base=self.steplog.base, read_back=self.read_back, **recovered)
            self.ctx.emit("step_log_recovered", base=self.steplog.base, read_back=self.read_back, **recovered)
        self.log.info("checkpointer listening", addr=self.addr, dir=str(self.store.root))

    def _log_files(self) -> LogFiles | None:
        """The step log's segments, written through (logfiles.py; none with checkpoint.step_log_spool false), read back
        only by a restart within the run: a previous checkpointer of it advertised itself (`cmemi up` clears the keys)."""
        self.read_back = bool(self.ctx.redis.exists(self.ctx.keys.checkpointer))
        files, removed = logfiles.opened(self.ctx.run_dir / "steplog", self.cfg.checkpoint.step_log_spool,
                                         self.read_back, lambda e, n: self.disk.full(self.latest or 0, e, 0, n))
        if removed:
            self.log.info("removed the step log's segments of a previous run", segments=removed)
        return files

    def _sync_pointer(self) -> None:
        """Move `latest` in Redis to the newest durable checkpoint; retried while Redis is away."""
        if self.latest is None:
            return
        try:
            if self.ctx.redis.get(self.ctx.keys.ckpt_latest) != str(self.latest):
                self.ctx.redis.set(self.ctx.keys.ckpt_latest, self.latest)
        except redis.RedisError as exc:
            self.log.warning("cannot move the latest pointer yet", step=self.latest, error=str(exc))

    @property
    def record(self) -> dict[Any, Any]:
        """Where the servers find this checkpointer: its address, incarnation and step log's address."""
        return {"addr": self.addr, "incarnation": self.member.incarnation, "log": self.logserver.addr}

    def _advertise(self) -> None:
        self.ctx.redis.hset(self.ctx.keys.checkpointer, mapping=self.record)
        self._sync_pointer()

    def latest_on_disk(self) -> None:
        if self.latest is None:  # rebuilt from the manifests on disk: the newest checkpoint that verifies
            for info in reversed(self.store.list()):
                problem = self.store.verify(info.path)
                if problem is None:
                    self.latest = info.step
                    break
                self._damaged(info.step, problem)

    def _damaged(self, step: int, problem: str) -> None:
        self.log.error("checkpoint damaged, falling back to an older one", step=step, problem=problem)
        self.ctx.emit("checkpoint_damaged", step=step, problem=problem)

    def _housekeeping(self, r: redis.Redis) -> str | None:
        """Once a second, off the loop (a Watch's thread: the step log's acknowledgements never wait on Redis):
        re-advertise if Redis lost its data, move the pointer; returns the run's state."""
        if not r.exists(self.ctx.keys.checkpointer):
            r.hset(self.ctx.keys.checkpointer, mapping=self.record)
        self._sync_pointer()
        return self.ctx.run_state()

    def run(self) -> None:
        next_check = 0.0
        watch = Watch(self.ctx.redis, 1.0, self._housekeeping, "checkpointer-housekeeping").start()
        try:
            while not self.ctx.stopping.is_set():
                if self.sock.poll(100):
                    self._receive()
                if time.monotonic() > next_check:
                    next_check = time.monotonic() + 1.0
                    self.drops.publish()
                    if (seen := watch.take()) is not None and seen[0] == "completed":  # the final checkpoint is on disk
                        self.log.info("run completed; exiting")
                        return
        finally:
            watch.stop()

    def _spool(self, of: dict, metas: list[dict]) -> Spool:
        """The sink of a message with tensors (assembly.Assembler): only a snapshot has any."""
        if of["type"] != "snapshot":
            raise protocol.ProtocolError("unexpected_type", f"a {of['type']!r} with tensors")
        return self._spool_file(of, metas)

    def _spool_file(self, of: dict, metas: list[dict]) -> Spool:
        step, shard = of["step"], of["shard"]
        total = sum(m["nbytes"] for m in metas)
        return Spool(self.store.root, step, shard, metas, lambda exc, attempt: self.disk.full(step, exc, total, attempt))

    def _receive(self) -> None:
        """One ZeroMQ message, read a frame at a time."""
        identity = self.sock.recv()
        if not self.sock.getsockopt(zmq.RCVMORE):
            self.drops.count("no_identity")
            return
        first = self.sock.recv(copy=False)
        if (role := self.ctx.curve.role(first)) is not None and role != "aggregator":
            protocol.drain(self.sock)
            self.drops.count("wrong_role", f"a message from a {role or 'unknown'} key")  # before any part is spooled
            return
        try:
            msg = self.parts.recv(self.sock, peer=identity, first=first, cap=self.cfg.cluster.message_cap())
        except protocol.ProtocolError as exc:
            self.drops.count(exc.reason, str(exc))
            return
        if msg is None:  # a part of a bigger snapshot; the rest is still coming
            return
        if (problem := self._refused(msg)) is not None:
            spool.discard(msg.tensors)
            self.drops.count(*problem)
            if problem[0] == "stale_term" and self.terms.unsure and msg.type == "snapshot":
                # no term to check it against (Redis restarted empty, or is away): the aggregator re-advertises its
                # term within a second, so its snapshot is asked for again rather than lost (it waits for an answer)
                self._reply(identity, "retry", {"step": msg.header["step"]})
            return
        if msg.type == "snapshot":
            if "shards" in msg.header:
                self._save_slice(identity, msg)
            else:
                try:
                    self._save([identity], msg.header["step"], msg.header["final"], msg.header["meta"], spool.of_message(msg.tensors))
                finally:
                    spool.discard(msg.tensors)
            return
        asked = (msg.header["term"], msg.header["shard"], msg.header["pid"] if msg.header["shard"] else None)
        if asked in self.restored_terms:  # a shard asks once, at its start
            self.drops.count("repeated_restore", f"term {asked[0]} shard {asked[1]}")
        else:
            self.restored_terms.add(asked)
            self._restore(identity, msg)

    def _refused(self, msg: protocol.Message) -> tuple[str, str] | None:
        """(reason, detail) if a whole message is dropped, else None."""
        if msg.type not in ("snapshot", "restore_req"):
            return "unexpected_type", msg.type
        if not self.terms.current(msg.header["term"]):
            return "stale_term", f"{msg.type} of term {msg.header['term']}, current {self.terms.term}"
        if msg.type == "snapshot" and (problem := meta_problem(msg.header, msg.tensors, self.cfg.train.rounds)
                                       or sharding_problem(msg.header)) is not None:
            return "bad_meta", problem
        return None

    def _save_slice(self, identity: bytes, msg: protocol.Message) -> None:
        """One shard's slice of a step; the checkpoint is written once every shard's is in (merge.py)."""
        done, given_up = self.merger.add(identity, msg.header, spool.of_message(msg.tensors))
        for step, senders in given_up:
            self.log.info("sharded checkpoint given up: a newer step came first", step=step)
            for ident in senders:
                self._reply(ident, "skipped", {"step": step})
        if done is None:
            return
        slices = [tensors for _, tensors in done.slices.values()]
        try:
            meta, tensors = merged(done)
            self._save(list(done.senders.values()), msg.header["step"], done.final, meta, tensors)
        except protocol.ProtocolError as exc:
            self.drops.count(exc.reason, str(exc))
            for ident in done.senders.values():
                self._reply(ident, "skipped", {"step": msg.header["step"]})
        finally:
            for tensors in slices:
                spool.discard(tensors)

    def _save(self, senders: list[bytes], step: int, final: bool, meta: dict, tensors: dict[str, Spooled]) -> None:
        t0 = time.monotonic()
        path = self.disk.write(step, meta, tensors)
        write_s = time.monotonic() - t0
        metrics.CHECKPOINT_SECONDS.observe(write_s)
        if final:
            try:
                atomic.copy_file(path / "model.safetensors", self.ctx.run_dir / "model.safetensors")
            except OSError as exc:
                self.disk.stop(step, exc, path.stat().st_size if path.exists() else 0)
        self.latest = step
        with self.steplog_lock:
            self.steplog.covered(step)
        self._sync_pointer()
        removed = self.store.retain(self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every, protect=step)
        size = sum(f.stat().st_size for f in path.iterdir())
        self.ctx.emit("checkpoint_saved", step=step, path=str(path), bytes=size, write_s=round(write_s, 4),
                      removed=removed, final=final)
        self.log.info("checkpoint saved", step=step, bytes=size, write_s=round(write_s, 3))
        self.drops.publish()  # before the ack: the final summary reads them right after it
        for identity in senders:
            self._reply(identity, "saved", {"step": step, "path": str(path)})

    def _latest_step(self) -> int | None:
        try:
            value = self.ctx.redis.get(self.ctx.keys.ckpt_latest)
        except redis.RedisError:
            value = None
        return int(value) if value is not None else self.latest

    def _restore(self, identity: bytes, msg: protocol.Message) -> None:
        """Restore what `latest` names; if it does not verify, the newest checkpoint that does. A shard k > 0 asks
        for exactly the step its leader restored (`step`): that one, or none."""
        latest = self._latest_step()
        infos = self.store.list()
        if (exact := msg.header["step"]) is not None:
            infos = [i for i in infos if i.step == exact]
        infos.sort(key=lambda i: (i.step == latest, i.step))  # the pointer's target first, then newest first
        for info in reversed(infos):
            problem = self.store.verify(info.path)
            if problem is None:
                meta = json.loads((info.path / "meta.json").read_text())
                try:
                    restore.send(self.sock, identity, self.ctx.run, {"step": info.step, "meta": meta}, info.path,
                                 self.cfg.cluster.message_cap(), self.cfg.cluster.checksum,
                                 restore.wanted(meta, self.cfg.cluster.shards, msg.header))
                except transfer.TooBig as exc:
                    self.ctx.fatal(f"checkpointer: {exc}")
                except TimeoutError as exc:  # its aggregator stopped reading: it asks again if it is alive
                    self.log.warning("restore not sent", step=info.step, error=str(exc))
                    return
                self.ctx.emit("checkpoint_restored", step=info.step, term=msg.header["term"])
                return
            self._damaged(info.step, problem)
        self._reply(identity, "no_checkpoint", {"term": msg.header["term"]})

    def _reply(self, identity: bytes, mtype: str, fields: dict, tensors: dict | None = None) -> None:
        """A reply (the restore is sent by restore.py)."""
        reply(self.ctx, self.sock, identity, mtype, fields, tensors)

    def close(self) -> None:
        self.logserver.close()
        self.steplog.clear()
        if self.steplog.files is not None:
            self.steplog.files.close()
        self.parts.close()  # and the spool files of what did not come whole
        self.merger.clear()
        self.member.stop()
        self.sock.close(linger=500)
        self.ctx.curve.close()
        self.zctx.destroy(linger=200)
