"""One intake for every parameter server (the leader and each shard k > 0): frames in, a message out or a drop.

What a received multipart message passes, in this order, before any handler sees it:
1. it has an identity and a body (`no_identity`);
2. the whole message is within `cluster.max_message_bytes` (`too_big`; ZeroMQ's MAXMSGSIZE bounds one frame);
3. its header passes the schema (declared in `shared/wire/messages/`, checked via `shared/wire/schema.py`:
   type, run, protocol version, fields); a part of a bigger message is taken only from an admitted peer, which
   bounds what an unauthenticated flood can make us allocate (`shared/wire/assembly.py`);
4. its type is one this server takes (`unexpected_type`);
5. with CurveZMQ, the sender's key has the role the type needs (`wrong_role`: `admission.ROLE_OF`).

Shared-memory slots (shared/memory/shm.py) are granted here too (`grant`, at a worker's admission): only to a worker whose
hello asks for them and whose messages come over the ipc:// endpoint (`local`). A granted worker's gradient names
a slot instead of carrying frames: its tensors are copied out of the slot here, and the copy is dropped if the slot
changed meanwhile (`shm_overwritten`); a descriptor from anyone else is dropped (`shm_unexpected`). An intake that
`borrows` (the leader's) hands out the slot's views instead: the handler reads them (sums them into a waiting
sibling, or copies them once, services/aggregator/common/gradients.py Spares) and then asks `intact()` whether the slot
stayed the worker's meanwhile. An honest worker writes that slot again only after work sent in answer to this very
gradient, so only a credentialed peer breaking the protocol can tear it, and the step is then collected again.

`Drops` counts every dropped message by reason in one place: the log (rate-limited), the run's counters
(reported in summary.json) and Prometheus.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from typing import Any

import structlog
import torch
from cmemi.services.aggregator.common.admission import ROLE_OF
from cmemi.services.aggregator.common.gradients import Spares
from cmemi.shared.core.innerstate import PREFIX as INNER
from cmemi.shared.memory import shm, shm_reader
from cmemi.shared.runtime import metrics
from cmemi.shared.wire import assembly, limits, protocol, samehost
from cmemi.shared.wire.security import Curve


class Drops:
    """Dropped messages by reason: logged (the first 5 of each, then every 1000th), counted, exported."""

    def __init__(self, log: structlog.stdlib.BoundLogger) -> None:
        self.log = log
        self.counts: Counter[str] = Counter()

    def __call__(self, reason: str, detail: str = "") -> None:
        self.counts[reason] += 1
        metrics.DROPPED.labels(reason).inc()
        n = self.counts[reason]
        if n <= 5 or n % 1000 == 0:
            self.log.warning("message dropped", reason=reason, detail=detail[:200], count=n)

    def as_dict(self) -> dict[str, int]:
        return dict(self.counts)


class Intake:
    """Turns a ROUTER's multipart messages into validated messages from peers with the right key role."""

    def __init__(self, run: str, cap: int, bound: int, checksum: bool, peers: int, curve: Curve,
                 types: Collection[str], admitted: Callable[[bytes], bool], drops: Drops, slots: bool = False,
                 borrows: bool = False, spare_bytes: int = 0) -> None:
        self.cap, self.curve, self.types, self.admitted, self.drop = cap, curve, frozenset(types), admitted, drops
        # messages bigger than one (a worker's gradient, a shard's pieces): one partial transfer per peer
        self.parts = assembly.Assembler(run, bound, checksum, peers=peers, on_abandon=drops)
        # peers whose last message came over ipc://, the most recent ones (a hello parked until every shard joined
        # is answered later: its sender is not admitted yet, so this is not kept to the admitted)
        self.local: OrderedDict[bytes, None] = OrderedDict()
        self.local_max = 4 * peers + 256
        self.granted: set[bytes] = set()  # admitted workers told to use slots (their welcome's "shm")
        self.slot_bytes = 0
        self.borrows = borrows
        # gradients land in the last step's buffers (gradients.py): two gradients' worth lent at once, what an honest
        # step of two workers brings; a gradient dropped (a duplicate, a stale one) or added into another gives its
        # buffers back once handled (`settle`); past two lent, a buffer is a plain allocation, freed with its message
        self.spares = Spares(limit=spare_bytes)
        self.lent: dict[str, Any] | None = None  # the descriptor whose views the message taken now holds
        self.slots = (shm_reader.Reader(run, shm.checksums(checksum), limit=2 * peers + 2, bound=bound)
                      if slots and shm.available() else None)

    def take(self, frames: list[Any]) -> tuple[bytes, protocol.Message | None, int] | None:
        """(sender identity, message or None while a bigger one's parts still come, bytes) — or None: dropped."""
        if len(frames) < 2:
            self.drop("no_identity")
            return None
        identity = frames[0].bytes
        self.slot_bytes, self.lent = 0, None  # of the message taken now: the bytes read from a slot, its views
        size = protocol.message_bytes(frames[1:])
        if size > self.cap:
            self.drop("too_big", f"{size} bytes")
            return None
        try:
            msg = self.parts.decode(identity, frames[1:], into=self._into, allow_parts=self.admitted(identity))
        except protocol.ProtocolError as exc:
            self.drop(exc.reason, str(exc))
            return None
        if samehost.came_local(frames[1]):
            self.local[identity] = None
            self.local.move_to_end(identity)
            while len(self.local) > self.local_max:
                self.local.popitem(last=False)
        else:
            self.local.pop(identity, None)
        if msg is None:
            return identity, None, size
        if msg.type not in self.types:
            self.drop("unexpected_type", msg.type)
            return None
        if (role := self.curve.role(frames[1])) is not None and role != ROLE_OF[msg.type]:
            self.drop("wrong_role", f"{msg.type} from a {role or 'unknown'} key")  # e.g. a worker key fencing
            return None
        if "shm" in msg.header and msg.type == "grad" and not self.admitted(identity):
            return identity, msg, size  # nothing read from it: the admission check names why (fenced, unknown)
        if "shm" in msg.header and msg.type == "grad":
            try:
                if self.slots is None or identity not in self.granted:
                    raise shm.ShmError("shm_unexpected", "a slot descriptor from a peer not granted slots")
                if msg.tensors:
                    raise shm.ShmError("shm_bad", "a slot descriptor and frames")
                if self.borrows:
                    msg.tensors, self.lent = self.slots.views(msg.header["shm"]), msg.header["shm"]
                else:
                    msg.tensors = self.slots.copied(msg.header["shm"])
            except protocol.ProtocolError as exc:
                self.drop(exc.reason, str(exc))
                return None
            # the gradient's bytes moved through the slot, not the socket: counted all the same (bytes_sent, the
            # codecs' ratios), so a summary means the same over any transport; `slot_bytes` says how many
            self.slot_bytes = limits.nbytes(msg.tensors.values())
            size += self.slot_bytes
        return identity, msg, size

    def _into(self, of: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """Where a gradient in parts lands: spares (its header is validated, its bytes within the bound). Not a
        replica's inner state (train.local_steps): the leader keeps it past the step, when the spares are lent again."""
        if of.get("type") != "grad":
            return None
        return self.spares.lend([m for m in of.get("tensors", []) if not str(m["name"]).startswith(INNER + ".")])

    def reclaim(self) -> None:
        """The step is over (applied, or its collection abandoned): its gradients' buffers are free again, but those of
        transfers still arriving."""
        self.spares.reclaim(busy=self.parts.receiving())

    def settle(self, held: list[torch.Tensor]) -> None:
        """A gradient message was handled: the spares no partial sum of the step holds (`held`) and no transfer is
        still arriving in are free again for its next gradient (one dropped as a duplicate or stale, the right operand
        of an add)."""
        self.spares.give_back([*held, *self.parts.receiving()])

    def release(self) -> None:
        """The run's steps are done: the kept gradient buffers go."""
        self.spares.clear()

    def intact(self) -> bool:
        """Did the slot whose views the message taken last holds stay unwritten until now (True if it holds none)?"""
        return self.lent is None or self.slots is None or self.slots.intact(self.lent)

    def grant(self, identity: bytes, hello: dict[str, Any]) -> bool:
        """Does the worker just admitted get slots (this server offers them, it asked, it came over ipc://)?"""
        if self.slots is not None and hello["shm"] and identity in self.local:
            self.granted.add(identity)
            return True
        self.granted.discard(identity)
        return False

    def keep(self, peers: Any) -> None:
        """Forget the unfinished transfers of peers no longer admitted (fenced, departed)."""
        self.parts.keep(peers)
        self.granted &= set(peers)
