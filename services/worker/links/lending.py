"""A same-host leader's parameters computed on where they lie, in its shared-memory slot (issue 31: the consumer
reads a version in place; nothing is copied into the model).

Over slots the leader writes each version once into one of two alternating slots (services/aggregator/common/publish.py);
`Inbox.lend` makes the model's parameters read-only views of it. The slot stays that version's until the leader
writes the version after next there, which it does only once this version's step is over: a worker still computing
then holds a stale lease, and the check after its computation (`valid`: the slot's sequence unchanged, shared/memory/shm.py)
drops what it computed, as a copy torn while read was dropped before. The step's buffers are still copied (the
forward pass changes the model's own), and so is every version that does not come through a slot.

A model whose forward pass writes its own parameters (weight clipping in place, say) must not get read-only views:
the write would be a segmentation fault. So the first version is copied, as before, and the parameters are
fingerprinted before and after its computation; only when they did not change are later versions lent. Where the
parameters are the target of other writes (a shard's rows, the downlink's mirror, local steps' inner optimizer, a
GPU), nothing is lent.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import xxhash
from cmemi.services.worker.links.inbox import Inbox
from cmemi.shared.memory import shm_reader
from cmemi.shared.wire import protocol


def _fingerprint(params: dict[str, torch.Tensor]) -> tuple[int, ...]:
    return tuple(xxhash.xxh3_64_intdigest(protocol.tensor_bytes(p.detach())) if p.numel() else 0
                 for p in params.values())


class Lend(Enum):
    """Whether a slot's versions are read in place, decided once a run (on the first version's computation)."""

    UNDECIDED = "undecided"  # nothing computed yet: the first version is copied and the parameters watched
    IN_PLACE = "in place"  # the model's passes leave its parameters alone: each version is lent
    COPY = "copy"  # not allowed here, a slot's tensors not each in one run, or a pass writes the parameters


class SlotLending:
    def __init__(self, inbox: Inbox, reader: shm_reader.Reader, params: dict[str, torch.Tensor], allowed: bool,
                 log: Any) -> None:
        self.inbox, self.reader, self.params, self.log = inbox, reader, params, log
        self.mode = Lend.UNDECIDED if allowed and inbox.lends else Lend.COPY
        self.probe: tuple[int, ...] | None = None
        self.desc: dict[str, Any] | None = None  # the slot the parameters are views of, while lent
        self.lent = 0  # versions lent so far: the first says so in the log (what only lending does, tests can see)

    def load(self, msg: protocol.Message) -> bool:
        """The parameters of `msg` (its tensors: views of a slot) into the model, lent or copied; False if they do not
        fit this model's layout."""
        if self.mode is Lend.IN_PLACE and self.inbox.lend(msg):
            self.desc = msg.header["shm"]
            self.lent += 1
            if self.lent == 1:
                self.log.info("a version lent: the model computes in the leader's slot")
            return True
        self.desc = None
        if self.mode is not Lend.COPY and not self.inbox.lendable(msg):  # a tensor's pieces apart in the slot
            self.mode = Lend.COPY
            self.log.info("the leader's slot does not hold each tensor in one run: parameters are copied from it")
        if not self.inbox.take(msg):
            return False
        if self.mode is Lend.UNDECIDED:
            self.probe = _fingerprint(self.params)
        return True

    def valid(self) -> bool:
        """Are the parameters still the version they were lent as (true when they are not lent)?"""
        return not self.inbox.lent or (self.desc is not None and self.reader.intact(self.desc))

    def computed(self) -> None:
        """After a computation on the first copied version: lend from now on if it left the parameters unchanged."""
        if self.probe is None:
            return
        same = _fingerprint(self.params) == self.probe
        self.probe, self.mode = None, Lend.IN_PLACE if same else Lend.COPY
        if same:
            self.log.info("parameters are read in place from the leader's slot")
        else:
            self.log.info("the model's forward or backward pass writes its parameters: each version is copied from the "
                          "leader's slot, not read in place")
