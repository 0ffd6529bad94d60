"""A worker's links to the parameter-server shards k > 0 (cluster.shards; docs/design.md, "Shards").

The leader (shard 0) leases and sends its own slice with `work`, as with one aggregator. For each
other shard the worker
- pulls the slice of the lease's parameter version (asked ahead, right after its previous gradient,
  so it is usually here already), which lands in its model's pieces (landing.py);
- sends that shard its slice of the gradient, every shard's at once (the leader's right after, on its
  own socket): no answer comes back; a slice that never arrives (this worker died between its sends) is
  leased again by the leader (services/aggregator/shard/server.py).

Pipelined (`cluster.pipeline_stages`: S), each shard's slice travels in S stages: the worker sends stage
0 of every shard, then stage 1, ..., and a pull is answered stage by stage as each one is stepped, so
parameters come back while later gradients still go out. The leader then holds no parameters.

Over ipc:// a shard may grant shared-memory slots (shared/memory/shm.py), as the leader does (joining.py): its slices then
come as slot descriptors (landing.py), and the worker's slices of each gradient go into a segment of its own per shard.

A shard that does not answer within `timeout` raises `Lost`: the worker says hello again. One whose lease or Redis
record names a new address (restarted within the term: shard_addrs.py) is linked to there in place (`relink`) before a
pull, an ask ahead or a push, so the lease in hand goes on; while the worker says hello (`connect`), it is `Lost`
too, and each shard is linked to where its record says it is.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq
from cmemi.services.worker.links.landing import SliceLanding
from cmemi.services.worker.links.shard_addrs import ShardAddrs
from cmemi.services.worker.links.shard_link import Link, Lost, Moved, answers, asking_slots
from cmemi.shared.config.schema import Config
from cmemi.shared.core.grid import Partition
from cmemi.shared.memory import shm
from cmemi.shared.runtime.links import set_link_options
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits, protocol, transfer
from cmemi.shared.wire.layout import Layout


class ShardLinks:
    def __init__(self, ctx: ServiceContext, cfg: Config, partition: Partition, params: dict[str, torch.Tensor],
                 ident: Callable[[], dict[str, Any]], link: Callable[[zmq.Socket, str, str], str]) -> None:
        self.ctx, self.cfg, self.partition, self.params, self.ident = ctx, cfg, partition, params, ident
        self.link = link  # connects a socket to a shard's address by the worker's transport rule (services/worker/links/joining.py `dial`)
        self.links: list[Link] = []
        self.term = -1
        self.timeout = max(10.0, 2 * cfg.cluster.dead_after)
        self.landing = SliceLanding(ctx, cfg)  # where each slice lands, and its copy into the model (landing.py)
        self.writers: dict[tuple[int, int], shm.Writer] = {}  # (shard, stage) -> this worker's segment for that slice
        self.addrs: ShardAddrs | None = None  # where each shard is now (its Redis record), read once connected
        self.zctx: zmq.Context | None = None  # (the worker's: a shard restarted in the term is linked to again)
        self.hello: dict[str, Any] = {}  # what this worker's hello says

    def connect(self, zctx: zmq.Context, addrs: list[str], term: int, hello: dict[str, Any]) -> None:
        """Say hello to every shard k > 0 (addresses from the leader's welcome, or newer ones from their Redis
        records); returns once all welcomed us."""
        self.close()
        self.term, self.zctx, self.hello = term, zctx, hello
        if self.addrs is None:
            self.addrs = ShardAddrs(self.ctx.redis, self.ctx.keys, self.cfg.cluster.shards)
        self.links = [self._open(k, self.addrs.newest(k, told)) for k, told in enumerate(addrs, start=1)]
        self._greet(self.links)

    def _open(self, k: int, addr: str) -> Link:
        me = self.ident()
        assert self.zctx is not None
        sock = self.zctx.socket(zmq.DEALER)
        set_link_options(sock, self.cfg.cluster)
        sock.setsockopt(zmq.IDENTITY, f"{me['wid']}/{me['inc']}/{self.term}/{k}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, limits.derive_max_message_bytes(self.cfg))
        # a slice asked ahead (ask_ahead) arrives before the worker fetches it: at most two of its parts queue
        # here, the rest waits in the shard's queue (zero-copy, its live pieces), not a copy of P here meanwhile
        sock.setsockopt(zmq.RCVHWM, 2)
        asks = self.link(sock, addr, f"shard{k}") == "ipc" and shm.suits(limits.nbytes(self.params.values()),
                                                                           self.cfg.cluster.workers)
        views = self.partition.views(self.params, k)
        staged = [{n: views[n] for n in names} for names in self.partition.staged(k)]
        parts = assembly.Assembler(self.ctx.run, limits.logical_bytes(self.cfg), self.cfg.cluster.checksum)
        link = Link(k, sock, [Layout(stage) for stage in staged], parts, staged)
        link.slots, link.addr = asks, addr  # (slots: until its welcome says whether it grants them)
        return link

    def _greet(self, links: list[Link]) -> None:
        """Say hello to `links`; returns once all welcomed us (a restarted shard: once its leader welcomed it)."""
        for link in links:
            self._send(link, "hello", **self.hello, **asking_slots(link.slots))
        welcomed: set[int] = set()

        def welcome(link: Link, msg: protocol.Message) -> None:
            if msg.type == "welcome" and msg.header["term"] == self.term:
                welcomed.add(link.k)
                link.slots = link.slots and msg.header["shm"]
        self._wait(lambda: welcomed >= {link.k for link in links}, welcome)

    def relink(self) -> None:
        """A shard restarted within the term (its record names a new address: shard_addrs.py): link to it there, in
        place, and say hello. The worker keeps its lease: said again to the leader, its lease would wait out the
        leader's grace before another worker got it (4 s at cluster.dead_after 2 s)."""
        while self.addrs is not None and (moved := self.addrs.moved({lk.k: lk.addr for lk in self.links})):
            i = next(i for i, link in enumerate(self.links) if link.k == moved[0])
            self.links[i].sock.close(linger=0)
            self.links[i] = self._open(*moved)
            self.ctx.log.info("a parameter-server shard restarted; linked to it there", shard=moved[0], addr=moved[1])
            self._greet([self.links[i]])

    def _send(self, link: Link, mtype: str, tensors: dict[str, torch.Tensor] | None = None,
              trackers: list[zmq.MessageTracker] | None = None, **fields: Any) -> None:
        msgs = transfer.messages(mtype, self.ctx.run, {**self.ident(), **fields},
                                 limits.derive_max_message_bytes(self.cfg), tensors, self.cfg.cluster.checksum,
                                 part=transfer.PART)
        transfer.send(link.sock, msgs, trackers=trackers)

    def _check_moved(self) -> None:
        """`Moved` if a shard's Redis record names another address than its link's (restarted: shard_addrs.py)."""
        if self.addrs is not None and (moved := self.addrs.moved({lk.k: lk.addr for lk in self.links})):
            raise Moved(*moved)

    def _wait(self, done: Callable[[], bool], handle: Callable[[Link, protocol.Message], Any]) -> None:
        """Receive from the shards until `done()`; `Lost` after `timeout` seconds without a message, or once a
        shard's record names a new address."""
        poller = zmq.Poller()
        for link in self.links:
            poller.register(link.sock, zmq.POLLIN)
        quiet_since = time.monotonic()
        by_sock = {link.sock: link for link in self.links}
        while not done():
            if self.ctx.stopping.is_set():
                raise Lost("stopping")
            if time.monotonic() - quiet_since > self.timeout:
                raise Lost(f"no answer from the parameter-server shards within {self.timeout:g} s")
            self._check_moved()
            events = poller.poll(100)
            if not events and self.addrs is not None:
                self.addrs.poke()  # a silent shard: is it restarting?
            for sock, _ in events:
                link = by_sock[sock]
                quiet_since = time.monotonic()
                try:
                    msg = link.parts.recv(sock, into=link.inbox if link.inbox is not None else
                                          functools.partial(self.landing.target, link))
                except protocol.ProtocolError as exc:
                    raise Lost(f"shard {link.k}: {exc}") from None
                if msg is None:
                    continue
                if msg.type == "reject":
                    if msg.header["fatal"]:
                        self.ctx.fatal(msg.header["reason"])
                    raise Lost(f"shard {link.k}: {msg.header['reason']}")
                if msg.type == "slice" and not msg.header["past"]:  # it waits until a lease needs its version (fetch)
                    stage = msg.header["stage"]
                    if msg.header["version"] != msg.header["asked"]:  # the step asked for is over
                        link.over = msg
                    elif 0 <= stage < len(link.got):
                        link.got[stage] = msg
                    else:
                        raise Lost(f"shard {link.k}: a slice of stage {stage!r}, expected 0..{len(link.got) - 1}")
                    continue
                handle(link, msg)

    def fetch(self, version: int) -> bool:
        """The slices of `version` from every shard into the model; False if a shard is past it (the step is over:
        the lease is stale)."""
        with self.landing.fetch(version):
            return self._fetch(version)

    def _fetch(self, version: int) -> bool:
        for i in range(len(self.links)):
            while True:
                try:
                    fetched = self._fetch_one(self.links[i], version)
                    break
                except Moved:  # restarted within the term: linked to it there, asked again
                    self.relink()
            if not fetched:
                return False
        return True

    def _fetch_one(self, link: Link, version: int) -> bool:
        if link.have != version:
            if not link.answered(version):
                # not asked yet, or what is here answers another pull: a late "that step is over" to an earlier
                # one (current version, no tensors), or a newer version asked ahead
                if link.asked != version:
                    self._send(link, "pull", term=self.term, version=version, have=link.have)
                    link.asked = version
                self._wait(functools.partial(link.answered, version), lambda _l, _m: None)
            if answers(link.over, version):
                return False
            if not self.landing.copy(link):  # a slot rewritten while read: pull it again, when the worker asks again
                link.reset()
                link.asked = link.have = -1
                return False
            link.consumed()
            link.have = version
        return True

    def push(self, encoded: list[list[tuple[dict[str, Any], dict[str, torch.Tensor]]]], fields: dict[str, Any],
             trackers: list[zmq.MessageTracker] | None = None, own: dict[int, dict[str, Any]] | None = None) -> None:
        """Send shard k its encoded slice, stage by stage (encoded[k - 1][g]: codec info, frames): stage 0 of every
        shard, then stage 1, ...; ZeroMQ's I/O thread carries them all at once, each shard's in order. `trackers`:
        the frames' trackers go there (services/worker/links/inflight.py). `own[k]`: header fields for shard k's
        alone (a replica's state's `inner`, train.inner_states: shards)."""
        self.relink()  # to where the lease or the record says a restarted shard is: never into the dead link
        for g in range(max((len(e) for e in encoded), default=0)):
            for link, stages in zip(self.links, encoded, strict=True):
                info, frames = stages[g]
                fields_k = {**fields, **(own or {}).get(link.k, {})} if g == 0 else fields
                if link.slots:  # into this worker's segment for shard k; only the descriptor goes
                    if (link.k, g) not in self.writers:  # one per stage: each stage's size is its own
                        checksum = shm.checksums(self.cfg.cluster.checksum)
                        self.writers[link.k, g] = shm.Writer(self.ctx.run, "worker", checksum)
                    self._send(link, "grad", tensors={}, shm=self.writers[link.k, g].write(frames), codec=info,
                               stage=g, **fields_k)
                else:
                    self._send(link, "grad", tensors=frames, trackers=trackers, codec=info, stage=g, **fields_k)

    def inner(self, k: int, r: int, version: int) -> protocol.Message:
        """Replica r's state for its lease of `version` from shard k, which keeps it (train.inner_states: shards;
        services/aggregator/shard/inner.py): asked (a `pull` naming it) and waited for (`Lost` as a pull's)."""
        link, got = next(lk for lk in self.links if lk.k == k), list[protocol.Message]()
        self._send(link, "pull", term=self.term, version=version, replica=r)
        self._wait(lambda: bool(got), lambda lk, m: got.append(m) if lk is link and m.type == "inner" and
                   m.header["replica"] == r else None)
        return got[0]

    def past(self, versions: list[int]) -> dict[tuple[int, int], protocol.Message]:
        """train.state_every > 1: every shard k > 0's pieces of the older `versions` a replay starts its rounds from
        (from its history, services/aggregator/shard/inner.py `past`), by (shard, version): all asked at once, then
        waited for (`Lost` as a pull's)."""
        self.relink()
        for link in self.links:
            for u in versions:
                self._send(link, "pull", term=self.term, version=u, past=True)
        want, got = {(lk.k, u) for lk in self.links for u in versions}, dict[tuple[int, int], protocol.Message]()
        self._wait(lambda: want <= got.keys(), lambda lk, m: got.setdefault((lk.k, m.header["asked"]), m)
                   if m.type == "slice" and m.header["past"] else None)
        return got

    def ask_ahead(self, version: int) -> None:
        """Pull `version` now, while the leader finishes the step: it is most often the next lease's."""
        self.relink()
        for link in self.links:
            if link.asked < version and link.have < version:
                self._send(link, "pull", term=self.term, version=version, have=link.have)
                link.asked = version

    def close(self) -> None:
        for link in self.links:
            link.sock.close(linger=0)
        self.links = []

    def close_slots(self) -> None:
        """Unlink this worker's segments, stop reading the shards' records (it exits)."""
        if self.addrs is not None:
            self.addrs.stop()
        for writer in self.writers.values():
            writer.close()
