"""A server's connection to the checkpointer's step log socket: where it is, a DEALER to it, sends that never wait,
and the replies read off it (link.py keeps the entries and their acknowledgements on top of it).

Its own DEALER to the checkpointer's step log socket (services/checkpointer/logserver.py: its own thread there, so
an entry never waits behind a checkpoint's parts or its write). That address (`log` in the checkpointer's Redis
record) is read at the start and again only when an acknowledgement is slow (a restarted checkpointer, on a new
address or incarnation: what it lost is sent again).

A checkpointer on this host (its address's host identity, shared/wire/samehost.py; `cluster.transport` not tcp) is
reached over its ipc:// endpoint, with CurveZMQ as over tcp://.

Nothing here waits on the checkpointer to send (issue 47, the 300-fault soak's stall at step 15,059). The DEALER
had no link options (shared/runtime/links.py) and no bound on its sends: after a one-way cut into the checkpointer's
host a connection stayed "established" while TCP retransmitted with a backoff of up to two minutes, so an entry in
it came after ACK_TIMEOUT_S if at all; an entry lost with a connection went again only to a restarted checkpointer;
and a send into a full pipe (the peer SIGSTOPped or cut: nothing read) blocked the server's loop. Now: the link
options, sends through a SendQueue (sendq.py: handed over as the socket takes them), and `late` says when what was
sent last is `resend_after` old (the caller sends it again).
"""

from __future__ import annotations

import time
from typing import Any

import redis
import zmq
from cmemi.shared.config.system import ClusterConfig
from cmemi.shared.coordination.membership import texts
from cmemi.shared.memory import shm
from cmemi.shared.runtime.links import link_timeout, set_link_options
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits, protocol, samehost
from cmemi.shared.wire.sendq import SendQueue

SNDHWM = 4  # ZeroMQ messages held for the checkpointer at most: the rest waits in the SendQueue, in order
QUEUED = 8  # logical messages the SendQueue keeps (a pending entry, a shard's two kept, their resends, log_reqs)


def resend_after(cluster: ClusterConfig) -> float:
    """Seconds an entry goes unacknowledged before it is sent again: 2 T, the link that lost it given up and redialled."""
    return 2 * link_timeout(cluster)


class LogConnection:
    def __init__(self, ctx: ServiceContext, zctx: zmq.Context, term: int, shard: int = 0) -> None:
        self.ctx, self.zctx, self.term, self.shard = ctx, zctx, term, shard
        self.cap = ctx.cfg.cluster.message_cap()
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(ctx.cfg), ctx.cfg.cluster.checksum)
        self.sock: zmq.Socket | None = None
        self.to: tuple[str | None, str | None] = (None, None)  # the checkpointer's (step log address, incarnation)
        self.local = False  # the checkpointer connected to is on this host (ipc://, slots)
        self.backlog: list[protocol.Message] = []  # replies read after the one a wait took
        self.shipped_bytes = 0
        self.queue = SendQueue("the checkpointer's step log", QUEUED, ctx.log)  # what the socket did not take yet
        self.sent_at = 0.0  # when the last message was put on its way (monotonic)
        self.resend_s = resend_after(ctx.cfg.cluster)

    def _where(self) -> tuple[str | None, str | None]:
        try:
            addr, inc = texts(self.ctx.redis.hmget(self.ctx.keys.checkpointer, ["log", "incarnation"]))
        except redis.RedisError:
            return self.to  # Redis away: keep talking to the checkpointer known
        return addr, inc

    def connect(self) -> bool:
        """(Re)connect if the checkpointer moved; True if the one now connected is not the one sent to before."""
        where = self._where()
        if where[0] is None or where == self.to:
            return False
        if where[0] != self.to[0] or self.sock is None:
            if self.sock is not None:
                self.sock.close(linger=0)
                self.parts.keep(())
            self.queue.clear()  # for the checkpointer gone: the caller sends what it needs again, to the new one
            self.sock = self.zctx.socket(zmq.DEALER)
            set_link_options(self.sock, self.ctx.cfg.cluster)  # a dead connection given up in T, dialled again
            self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
            self.ctx.curve.connect_as_client(self.sock)  # CurveZMQ over ipc:// too (samehost.bind_ipc)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, self.cap)
            ipc = samehost.same_host(where[0], self.ctx.cfg.cluster.transport) if shm.available() else None
            self.local = ipc is not None
            self.sock.connect(ipc or samehost.tcp_of(where[0]))
        self.to = where
        return True

    def send(self, msgs: list[list[Any]]) -> None:
        """Put one logical message (`transfer.messages`) on its way: handed over now as far as the socket takes it."""
        if self.sock is None:
            self.connect()
        if self.sock is not None:
            self.queue.put(msgs)
            self.sent_at = time.monotonic()
            self._flush()

    def _flush(self) -> int:
        """Hand the socket what it takes now of what waits; returns the bytes handed over."""
        n = self.queue.flush(self.sock) if self.sock is not None and len(self.queue) else 0
        self.shipped_bytes += n
        return n

    def late(self) -> bool:
        """Was the last message sent `resend_s` ago or more, and nothing of it is still waiting to go?"""
        return time.monotonic() - self.sent_at >= self.resend_s and not len(self.queue)

    def moved(self) -> bool:
        """True if the checkpointer restarted (or was not known yet): what it lost is to be sent again."""
        return self.connect()

    def replies(self, timeout_ms: int = 0) -> list[protocol.Message]:
        """The replies read before and not taken (`wait`), then those that came, waiting up to `timeout_ms` for one.

        Without a wait, nothing to hand over and nothing readable, it asks the socket's ZMQ_EVENTS alone: the
        leader asks after every message its loop reads until the step's ack is in (1.8 times a step in a cnn1d run
        of bench/step_cpu.py), and a `poll` there made a Poller and a zmq_poll each time (34 us of CPU a call on a
        loaded 2-core machine, thread_time around it, the ack's own receive included)."""
        out, self.backlog = self.backlog, []
        if not (out or timeout_ms or len(self.queue) or self.readable()):
            return out
        deadline = time.monotonic() + (0 if out else timeout_ms / 1000)
        while self.sock is not None:
            handed = self._flush()  # what waits goes as the socket takes it, while this waits for replies
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = protocol.poll(self.sock, wait_ms, protocol.POLLIN | (protocol.POLLOUT if len(self.queue) else 0))
            if not events & protocol.POLLIN:
                if events & protocol.POLLOUT and handed:
                    continue
                break
            if (msg := self.parts.reply(self.sock, self.ctx.log, "checkpointer")) is not None:
                out.append(msg)
            if not (len(self.queue) or self.readable()):  # (ZMQ_EVENTS: a zmq_poll more only when there is more)
                break
            deadline = 0.0
        return out

    def readable(self) -> bool:
        """Is a reply waiting to be read now? (ZMQ_EVENTS: no syscall unless the I/O thread signalled something.)"""
        events = self.sock.getsockopt(protocol.EVENTS) if self.sock is not None else 0
        return isinstance(events, int) and bool(events & protocol.POLLIN)  # (an int option: typed int | bytes)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.parts.close()
