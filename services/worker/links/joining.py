"""How a worker (re)joins the cluster: find the leader of the current term in Redis, say hello, wait to be welcomed,
then connect to the other shards it names.

Over ipc:// (a same-host leader, `cluster.transport` auto or shm) the hello asks for shared-memory slots
(shared/memory/shm.py); a welcome that grants them means parameters come as a slot's descriptor and the leader's slice
of each gradient goes into a slot of this worker's own. A welcome always resets the version held (a new term may have
rolled back: its parameters are always taken). Until welcomed, a `stop` or `reject` is handled as ever (`refused`);
no welcome within max(5 s, 3 x cluster.dead_after) is a new try, once the fence is checked.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, cast

import redis
import torch
import zmq
from cmemi.services.worker.lifecycle import Lifecycle
from cmemi.services.worker.links.leader import LeaderLink
from cmemi.services.worker.links.shard_links import Lost, ShardLinks, asking_slots
from cmemi.shared.config.schema import Config
from cmemi.shared.core.environment import environment
from cmemi.shared.memory import shm
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import protocol, samehost


class Joining:
    def __init__(self, ctx: ServiceContext, cfg: Config, life: Lifecycle, link: LeaderLink, fp: dict[str, Any],
                 param_bytes: int, forget: Callable[[], None], refused: Callable[[protocol.Message], None]) -> None:
        self.ctx, self.cfg, self.life, self.link, self.fp = ctx, cfg, life, link, fp
        self.param_bytes, self.forget, self.refused = param_bytes, forget, refused
        self.host = socket.gethostname()
        self.shard_links: ShardLinks | None = None  # (set by the worker: they are made with `dial`)

    def _aggregator(self) -> tuple[str, int] | None:
        try:
            info = cast("dict[str, str]", self.ctx.redis.hgetall(self.ctx.keys.aggregator))  # decoded (membership.text)
        except redis.RedisError:
            return None
        if "addr" not in info:
            return None
        return info["addr"], int(info["term"])

    def dial(self, sock: zmq.Socket, addr: str, peer: str) -> str:
        """Connect to a server over ipc:// when it is on this host, else CurveZMQ tcp:// (cluster.transport); returns
        the transport taken."""
        try:
            kind = samehost.connect(self.ctx.curve, sock, addr, self.cfg.cluster.transport, peer)
        except samehost.TransportError as exc:
            self.ctx.fatal(f"worker {self.link.sender.get('wid')}: {exc}")
        self.life.transport(peer, kind)
        return kind

    def connect(self, device: torch.device) -> None:
        """(Re)connect to the current aggregator and say hello; returns once welcomed (or stopping)."""
        while not self.ctx.stopping.is_set():
            self.life.exit_if_finished()
            found = self._aggregator()
            if found is None:
                time.sleep(0.05)
                continue
            addr, term = found
            sock = self.link.open(f"{self.link.sender['wid']}/{self.link.sender['inc']}/{term}")
            self.dial(sock, addr, "aggregator")
            self.link.addr = addr
            hello: dict[str, Any] = {"fp": self.fp, "host": self.host, "env": environment(device, self.cfg)}
            asks = self.life.links.get("aggregator") == "ipc" and shm.suits(self.param_bytes, self.cfg.cluster.workers)
            self.link.send("hello", **hello, **asking_slots(asks))
            if self._welcomed(addr, hello, asks):
                return
            self.life.check_fenced()

    def _welcomed(self, addr: str, hello: dict[str, Any], asks: bool) -> bool:
        """Wait for the welcome to our hello; True once welcomed and linked to every shard."""
        link = self.link
        deadline = time.monotonic() + max(5.0, 3 * self.cfg.cluster.dead_after)
        while time.monotonic() < deadline and not self.ctx.stopping.is_set():
            msg = link.recv(100)
            if msg is None:
                continue
            if msg.type != "welcome":
                self.refused(msg)
                continue
            link.term = msg.header["term"]
            link.slots = asks and msg.header["shm"]
            if link.slots:  # status and the joined line say so: ipc:// carries descriptors only
                self.life.transport("aggregator", "shm")
            self.forget()  # a new term may have rolled back: always take its parameters
            link.lost_reply = False  # the caller asks for work next anyway
            assert self.shard_links is not None
            try:
                self.shard_links.connect(link.zctx, msg.header["shards"], link.term, hello)
            except Lost as exc:
                self.ctx.log.warning("a parameter-server shard did not welcome us; trying again", error=str(exc))
                return False
            for shard in self.shard_links.links:
                if shard.slots:
                    self.life.transport(f"shard{shard.k}", "shm")
            self.ctx.log.info("joined", aggregator=addr, transport=self.life.links, term=link.term,
                              step=msg.header["step"], shards=1 + len(self.shard_links.links))
            self.life.forget_readings()
            return True
        return False
