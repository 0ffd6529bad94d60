"""The step log's own socket, on its own thread: a server's step waits for this acknowledgement, so it must never
wait behind what the checkpointer's loop does — writing a checkpoint (seconds for a big model, with its fsyncs) or
a Redis call while Redis is away (docs/design.md §6).

A ROUTER of its own (CurveZMQ, aggregator keys only, port 0), advertised beside the checkpointer's address in its
Redis record (`log`); the servers' StepLogLink connects to it. It takes `step_log` and `log_req` only, of the
current term (admission.TermWatch, its own, which reads Redis only when a message names a term it has not seen).
The log itself (steplog.py) is shared with the loop, which drops what each checkpoint covers: one lock.

A server on this host (the address's host identity, services/aggregator/steplog/link.py) reaches it over ipc:// —
with CurveZMQ still, bound without the workers' PLAIN (`samehost.bind_ipc`): the aggregator's key is proven as over
tcp:// — and ships each entry's tensors in a shared-memory slot of its own (`shm` in the header, a descriptor as a
worker's gradient's), copied here once into the log (with the spool on, into its segment straight from the slot, a
chunk at a time: `_landed`) before the ack; the replies of a replay come
back the same way, each server's replay through a ring of its own (`slots[shard]`): a leader and a shard may
replay at once, and one ring would let either overwrite the other's entry. Over tcp://, CurveZMQ carried the 2.4 MB
entry of bench/recovery.py's model at about 2.5 ms of CPU per step on two sides of a 2-core machine, most of the log's
step-time overhead there (issue 47); a shard's replay paid it until it had a ring too.

The thread owns the socket and what it reads into: it closes them itself as it ends, and `close` waits for that. A
ZeroMQ socket is not thread-safe: closed from another thread while this one still polled it (a join that timed out
after 2 s under load, then `sock.close`, or the context's `destroy`), libzmq asserts and the whole process aborts
(CI's pytest process died so, SIGABRT, in stop 55's run).
"""

from __future__ import annotations

import os
import threading

import zmq
from cmemi.services.checkpointer import spool
from cmemi.services.checkpointer.admission import TermWatch
from cmemi.services.checkpointer.drops import Drops
from cmemi.services.checkpointer.logfiles import Stored
from cmemi.services.checkpointer.steplog import Entry, Held, SlotBytes, StepLog, Streamed
from cmemi.services.checkpointer.steplog_replies import LogReplies
from cmemi.shared.memory import shm, shm_reader
from cmemi.shared.runtime.links import set_link_options
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits, protocol, samehost, transfer


def reply(ctx: ServiceContext, sock: zmq.Socket, identity: bytes, mtype: str, fields: dict,
          tensors: dict | None = None) -> None:
    """One reply of the checkpointer's (either socket's), in parts past the message cap."""
    try:
        transfer.send(sock, transfer.messages(mtype, ctx.run, fields, ctx.cfg.cluster.message_cap(), tensors,
                                              ctx.cfg.cluster.checksum), identity)
    except transfer.TooBig as exc:
        ctx.fatal(f"checkpointer: {exc}")


class Reads:
    """A replay's tensors read from the log's segment files into a slot (`whole`: its bytes), as few `preadv`s as can
    be: each run of tensors that lie in one segment as they lie in the slot (an entry's record holds its tensors at
    ALIGN offsets, as a slot does) in one, padding and all. One `preadv` per tensor was a system call, and a release
    and a retake of the GIL, per piece of the model: 24 an entry for bench/recovery.py's MLP (issue 47)."""

    def __init__(self, whole: memoryview) -> None:
        self.whole = whole
        self.fd: int | None = None
        self.file = self.slot = self.length = 0  # the run: where it starts in its segment and in the slot, its bytes
        self.where: Stored | None = None  # (the run's first tensor: its segment named in an error)

    def add(self, t: Stored, at: int) -> None:
        """Tensor `t`, to be read into the slot at `at`."""
        if t.segment.fd != self.fd or t.offset - self.file != at - self.slot or t.offset < self.file + self.length:
            self.done()
            self.fd, self.file, self.slot, self.length, self.where = t.segment.fd, t.offset, at, 0, t
        self.length = t.offset + t.nbytes - self.file

    def done(self) -> None:
        """Read the run gathered so far (if any)."""
        if self.fd is None:
            return
        if (got := os.preadv(self.fd, [self.whole[self.slot:self.slot + self.length]], self.file)) != self.length:
            path = self.where.segment.path if self.where is not None else "?"
            raise OSError(f"step log segment {path}: {got} of {self.length} bytes at {self.file}")
        self.fd = None


STREAM_CHUNK = 8 << 20  # bytes of a same-host entry's slot written to the spool at a time (`Streamed`)
CLOSE_S = 30.0  # the longest `close` waits for the thread (a big entry's spool write, a Redis call while Redis is away)


class LogServer:
    def __init__(self, ctx: ServiceContext, zctx: zmq.Context, log: StepLog, lock: threading.Lock) -> None:
        self.ctx, self.cfg, self.log, self.lock = ctx, ctx.cfg, log, lock
        self.sock = zctx.socket(zmq.ROUTER)
        set_link_options(self.sock, self.cfg.cluster)  # a dead link noticed in seconds (shared/runtime/links.py)
        ctx.curve.serve(zctx, self.sock)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.cluster.message_cap())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = protocol.bind(self.sock, self.cfg.cluster.host, 0)
        self.local = False  # an ipc:// endpoint: a same-host server's replay may ask for slots
        self.slots: dict[int, shm.Writer] = {}  # shard -> the ring of its replay's entries (made at its first ask)
        self.slotted: dict[bytes, int] = {}  # the peers whose log_req asked for slots (`shm`) -> their shard
        self.raw = SlotBytes()  # (a slot's byte views, the spool off: one numpy copy per tensor)
        self.reader = shm_reader.Reader(ctx.run, self.cfg.cluster.checksum, limit=4, bound=limits.logical_bytes(self.cfg))
        if self.cfg.cluster.transport != "tcp" and shm.available():
            try:
                local = samehost.bind_ipc(self.sock, ctx.run_dir, "steplog")
            except (samehost.TransportError, zmq.ZMQError) as exc:
                ctx.log.warning("step log: no ipc:// endpoint; same-host servers use tcp://", error=str(exc))
            else:
                self.addr = samehost.advertise(self.addr, local)
                self.local = True
        self.drops = Drops(ctx.redis, ctx.keys, ctx.log)  # published from this thread, when it has any
        # one partial entry per server (K of them), plus one for a restarted server's new connection
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(self.cfg), self.cfg.cluster.checksum,
                                        peers=self.cfg.cluster.shards + 1, on_abandon=self.drops.count,
                                        sink=self._sink)
        self.terms = TermWatch(ctx.redis, ctx.keys)
        self.replies = LogReplies(log, self._reply, ctx.emit, self.cfg.cluster.shards, self._slotted)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-log", daemon=True)

    def start(self) -> LogServer:
        self._thread.start()
        return self

    def _sink(self, of: dict, metas: list[dict]) -> Held | spool.Spool:
        if of["type"] != "step_log":
            raise protocol.ProtocolError("unexpected_type", f"a {of['type']!r} with tensors")
        return self.log.sink(of, metas)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if protocol.poll(self.sock, 100):
                    self._receive()
                elif self.drops.unpublished:
                    self.drops.publish()
        finally:
            self._release()

    def _receive(self) -> None:
        identity = self.sock.recv()
        if not self.sock.getsockopt(protocol.RCVMORE):
            self.drops.count("no_identity")
            return
        first = self.sock.recv(copy=False)
        if (role := self.ctx.curve.role(first)) is not None and role != "aggregator":
            protocol.drain(self.sock)
            self.drops.count("wrong_role", f"a step log message from a {role or 'unknown'} key")
            return
        try:
            msg = self.parts.recv(self.sock, peer=identity, first=first, cap=self.cfg.cluster.message_cap())
        except protocol.ProtocolError as exc:
            self.drops.count(exc.reason, str(exc))
            return
        if msg is None:  # a part of a bigger entry; the rest is still coming
            return
        if msg.type == "step_log" and "shm" in msg.header and not self._landed(msg):
            return
        if msg.type == "log_req" and msg.header["shm"] and self.local:
            self.slotted[identity] = int(msg.header["shard"])
        if msg.type not in LogReplies.TYPES or not self.terms.current(msg.header["term"]):
            spool.discard(msg.tensors)
            reason = "unexpected_type" if msg.type not in LogReplies.TYPES else "stale_term"
            self.drops.count(reason, f"{msg.type} of term {msg.header.get('term')}")
            return
        with self.lock:
            try:
                self.replies.handle(identity, msg)
            except shm.ShmError as exc:  # a same-host entry's slot, read as it was written (`Streamed`): not logged
                self.drops.count(exc.reason, str(exc))

    def _landed(self, msg: protocol.Message) -> bool:
        """An entry whose tensors are in the sender's slot: copied into the log's memory (or its spool file) as an
        entry off the wire would be, then the slot checked unchanged. False (dropped, counted) if it cannot be.

        With the spool on, nothing is copied here: the entry goes on as `Streamed`, which `StepLog.add` writes into
        the log's segment straight from the slot, `STREAM_CHUNK` bytes at a time (at most the transfer cap), each
        chunk unmapped from this process once written; the slot is checked there (`Streamed.finish`), a failure
        dropped and counted by `_receive`. Landing it in a buffer as big as the entry first, with the server's slots
        left mapped, made the checkpointer's peak 1,659 MB for bench/memory.py's 452 MB entry (issue 47)."""
        desc = msg.header["shm"]
        sink: Held | spool.Spool | None = None
        try:
            if self.log.files is not None:
                msg.tensors = Streamed(desc["tensors"], desc["at"], self.reader.slot(desc),
                                       min(STREAM_CHUNK, self.cfg.cluster.message_cap()),
                                       lambda lo, hi: self.reader.unmap(desc, lo, hi), lambda: self.reader.intact(desc))
                return True
            views = self.reader.views(desc)
            sink = self.log.sink(msg.header, desc["tensors"])
            if isinstance(sink, Held):
                sink.fill(self.raw.of(desc, views))
            else:
                for ti, meta in enumerate(desc["tensors"]):
                    if meta["nbytes"]:
                        sink.write(ti, 0, protocol.tensor_bytes(views[meta["name"]]))
            del views
            if not self.reader.intact(desc):
                raise shm.ShmError("shm_overwritten", f"{desc['seg']} slot {desc['slot']}: written while read")
        except protocol.ProtocolError as exc:
            if isinstance(sink, Held | spool.Spool):
                sink.discard()
            self.drops.count(exc.reason, str(exc))
            return False
        msg.tensors = sink.pieces() if isinstance(sink, Held) else sink.result()
        return True

    def _reply(self, identity: bytes, mtype: str, fields: dict, tensors: dict | None = None) -> None:
        if tensors and (shard := self.slotted.get(identity)) is not None:  # a same-host replay: the entry in a slot
            fields = {**fields, "shm": self._ring(shard).write(tensors)}
            tensors = {}
        reply(self.ctx, self.sock, identity, mtype, fields, tensors)

    def _ring(self, shard: int) -> shm.Writer:
        if shard not in self.slots:
            self.slots[shard] = shm.Writer(self.ctx.run, f"steplog{shard or ''}", shm.checksums(self.cfg.cluster.checksum))
        return self.slots[shard]

    def _slotted(self, identity: bytes, after: int | None, run: list[tuple[dict, Entry]], end: bool) -> bool:
        """A same-host replay's entries (`run`: one `log_entry` where `after` is None, else one `log_entries`) read
        from the log's segment file straight into the asker's slot (one copy, from the page cache; what is held in
        memory is copied in as before). False: the asker has no slot (frames). Reading each entry first
        (`Entry.loaded`: a `bytes` per tensor from `pread`, copied into a `bytearray`), then into the slot, was three
        copies and two allocations per tensor, the checkpointer's larger share of a replayed step (issue 47)."""
        if (shard := self.slotted.get(identity)) is None:
            return False
        named = [(n if after is None else f"{i}/{n}", t) for i, (_, e) in enumerate(run) for n, t in e.tensors.items()]
        if not named:
            return False
        ring = self._ring(shard)
        held = {name: t for name, t in named if not isinstance(t, Stored)}
        loaded = Entry({}, held, 0).loaded() if held else {}
        metas = [{"name": name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes} if isinstance(t, Stored)
                 else {"name": name, "dtype": protocol.DTYPE_NAMES[loaded[name].dtype], "shape": list(loaded[name].shape),
                       "nbytes": loaded[name].numel() * loaded[name].element_size()} for name, t in named]
        slot, views = ring.begin(metas)
        whole = protocol.tensor_bytes(ring.wholes[slot])  # (one byte view of the slot: a view per tensor cost 24 us)
        reads = Reads(whole)
        for view, at, (name, t) in zip(views, ring.opened[slot], named, strict=True):
            if isinstance(t, Stored) and t.nbytes and t.segment.fd is not None:
                reads.add(t, at)
                continue
            reads.done()  # (a run covers only the places of the tensors it reads: none copied in between)
            if not isinstance(t, Stored):
                view.copy_(loaded[name])
            elif t.nbytes:
                raise OSError(f"a step log entry read after its segment {t.segment.path} was deleted")
        reads.done()
        desc = ring.commit(slot, metas, views)
        if after is None:
            reply(self.ctx, self.sock, identity, "log_entry", {**run[0][0], "shm": desc}, {})
        else:
            reply(self.ctx, self.sock, identity, "log_entries",
                  {"after": after, "entries": [f for f, _ in run], "end": end, "shm": desc}, {})
        return True

    def close(self) -> None:
        """Stop the thread and wait until it has closed its socket (the module docstring: never closed from here while
        it runs). It ends within a poll (0.1 s) unless a message is being received or written; a write that takes
        longer than `CLOSE_S` is left to finish and close on its own, and the caller is told by the log."""
        self._stop.set()
        if not self._thread.is_alive() and self._thread.ident is None:  # never started: nothing else holds it
            self._release()
            return
        self._thread.join(timeout=CLOSE_S)
        if self._thread.is_alive():
            self.ctx.log.error("step log thread still busy; it closes its socket when it ends", waited_s=CLOSE_S)

    def _release(self) -> None:
        self.parts.close()
        self.sock.close(linger=0)
        for ring in self.slots.values():
            ring.close()
