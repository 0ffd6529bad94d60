"""The leader's parameters of a `work` into the model, by whichever way they came, and the version the model holds.

A `work` carries the leader's slice one of five ways, each with its own check before the model holds the version the
lease names:
- tensors on the socket: they landed in the inbox as they arrived (services/worker/links/inbox.py), `Inbox.take`;
- a descriptor of a same-host leader's shared-memory slot: read in place or copied (services/worker/links/lending.py),
  used only if the slot was not rewritten meanwhile;
- compression.downlink's change from our version, into the model's pieces as the mirror (shared/compression/downlink.py);
- streaming's pieces changed since our version (shared/core/fragments.py);
- nothing, where the leader holds no parameters (pipelined, or more shards than a codec's whole-tensor pieces).
A way that fails leaves the model holding no version (`version` None): the worker then asks for a whole one, `want`
with `number` = NOTHING. Parameters of another model (another config on this host) stop the worker with one line.
"""

from __future__ import annotations

from typing import Any

import torch
from cmemi.services.worker.links.inbox import Inbox
from cmemi.services.worker.links.lending import SlotLending
from cmemi.shared.compression import downlink
from cmemi.shared.compression.base import CodecError
from cmemi.shared.config.schema import Config
from cmemi.shared.core import fragments as fragmenting
from cmemi.shared.core.buffers import PREFIX
from cmemi.shared.core.grid import Partition
from cmemi.shared.memory import shm_reader
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import protocol

NOTHING = -1  # the version a `want` names when the model holds none: the leader then sends the whole parameters


class Intake:
    def __init__(self, ctx: ServiceContext, cfg: Config, partition: Partition, params: dict[str, torch.Tensor],
                 step_buffers: dict[str, torch.Tensor], slot_reader: shm_reader.Reader, lends: bool) -> None:
        self.ctx, self.log, self.partition, self.params = ctx, ctx.log, partition, params
        self.step_buffers, self.slot_reader = step_buffers, slot_reader
        # compression.downlink: the model's parameters are the mirror, moved by each version's change
        self.downlink = downlink.codec(cfg.compression) if cfg.compression.downlink != "none" else None
        self.downlink_dropped = 0  # changes refused as malformed (the whole mirror is asked for instead)
        self.lends = lends  # nothing but the slot writes the parameters (no downlink mirror, no local steps)
        self._version: int | None = None
        self.wid = "?"
        self.place(torch.device("cpu"))

    def place(self, device: torch.device) -> None:
        """Where parameters land on `device`; the leader's slot read in place only where nothing but the slot writes
        the parameters (the inbox rules out shards' rows and a GPU)."""
        self.inbox = Inbox(self.partition, self.params, self.step_buffers, device)
        self.lending = SlotLending(self.inbox, self.slot_reader, self.params, self.lends, self.log)

    @property
    def version(self) -> int | None:
        """The version the model holds; None: none (never received, half written, or torn)."""
        return self._version

    @version.setter
    def version(self, number: int | None) -> None:
        self._version = None if number is None or number < 0 else number

    @property
    def number(self) -> int:
        """The version held as the wire names it (a `want`, a gradient, a shard's pull): NOTHING when none."""
        return NOTHING if self._version is None else self._version

    def forget(self) -> None:
        """The model's parameters may be half written (or from another term): hold no version."""
        self.version = None

    def receive(self, msg: protocol.Message, slots: bool) -> bool:
        """The parameters of `msg` into the model (`slots`: the leader granted shared-memory slots on this connection);
        True when the model then holds the version the lease names, else it holds none."""
        h = msg.header
        delta = h["downlink"] == downlink.DELTA  # (a change is from `base`: checked before the version moves)
        pieces = h["downlink"] == fragmenting.PIECES
        if not msg.tensors and not self.inbox.tensors and not delta and not pieces:  # nothing to receive: a leader
            self.version = h["version"]  # without pieces (pipelined, or more shards than a codec's whole-tensor pieces)
        if delta:
            taken = self.apply_change(msg)  # not our version's, or malformed: the whole mirror instead
        elif pieces:
            taken = self.take_pieces(msg)
        elif "shm" in h and slots and not msg.tensors:
            taken = self.from_slot(msg)
        else:
            taken = True
            if msg.tensors:
                if not self.inbox.take(msg):  # checksums passed: the aggregator's model is not ours (another config)
                    self._misfit(h)
                self.version = h["version"]
        if not taken or self.number != h["version"]:  # (a correct aggregator: never the latter) never compute stale
            self.version = None
            return False
        return True

    def _misfit(self, h: dict[str, Any]) -> None:
        self.ctx.fatal(f"worker {self.wid}: the aggregator's parameters (layout {str(h['layout'])[:16]}) "
                       f"do not fit this worker's model (layout {self.inbox.layout.digest}, shared/wire/layout.py): "
                       "use the same model.factory and model.kwargs on every host")

    def from_slot(self, msg: protocol.Message) -> bool:
        """The parameters of a `work` whose tensors are in the leader's slot, into the model; False (and the model
        holds no version) if the slot is bad or was rewritten while copied: the caller asks again."""
        h = msg.header
        try:
            views = self.slot_reader.views(h["shm"])
        except protocol.ProtocolError as exc:
            self.log.warning("parameters slot unusable; asking again", reason=exc.reason, detail=str(exc)[:200])
            return False
        fits = self.lending.load(protocol.Message(h, views))
        del views
        if not fits:
            self._misfit(h)
        if not self.slot_reader.intact(h["shm"]):
            self.log.info("parameters slot rewritten while read; asking again", version=h["version"])
            return False
        self.version = h["version"]
        return True

    def apply_change(self, msg: protocol.Message) -> bool:
        """compression.downlink: the leader's change from our version (`base`) into the mirror (the model's pieces),
        by the function the servers use; the step's buffers come with it, dense. False, and nothing changed, when it
        is not from our version or is malformed (counted)."""
        h, tensors = msg.header, msg.tensors
        if self.downlink is None or self.version is None or h["base"] != self.version:
            self.log.info("a parameter change from another version; asking for the whole mirror", base=h["base"],
                          have=NOTHING if self.version is None else self.version)
            return False
        found = {n: tensors.get(PREFIX + n) for n in self.step_buffers}
        buffers = {n: b for n, b in found.items() if b is not None}
        try:
            if len(buffers) != len(found) or any(
                    b.shape != self.step_buffers[n].shape or b.dtype != self.step_buffers[n].dtype
                    for n, b in buffers.items()):
                raise CodecError("bad_buffers", "the step's buffers are missing or do not match the model")
            pieces = self.partition.views(self.params, 0)
            downlink.apply(self.downlink, pieces, h["codec"],
                           {k: t for k, t in tensors.items() if not k.startswith(PREFIX)},
                           {n: tuple(p.shape) for n, p in pieces.items()})
        except CodecError as exc:
            self.downlink_dropped += 1
            self.log.warning("parameter change dropped; asking for the whole mirror", reason=exc.reason,
                             detail=str(exc)[:200], dropped=self.downlink_dropped)
            return False
        with torch.no_grad():
            for n, b in self.step_buffers.items():
                if buffers[n] is not b:
                    b.copy_(buffers[n])
        self.version = h["version"]
        return True

    def take_pieces(self, msg: protocol.Message) -> bool:
        """Streaming: the leader's pieces that the steps since our version changed, and the step's buffers
        (fragments.PIECES), into the model; False when they are not from our version or do not fit it (the whole
        version is asked for then)."""
        h, buffers = msg.header, {PREFIX + n: b for n, b in self.step_buffers.items()}
        if self.version is None or h["base"] != self.version or not fragmenting.land(
                msg.tensors, {**self.partition.views(self.params, 0), **buffers}, buffers):
            self.log.info("changed pieces not from our version, or not our model's; asking for the whole version",
                          base=h["base"], have=self.number)
            return False
        self.version = h["version"]
        return True
