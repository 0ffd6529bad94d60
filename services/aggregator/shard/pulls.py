"""A shard's answers to workers' pulls: each stage of its slice at the version asked for, as soon as it has it.

Version s is served while step s collects; pipelined, a stage stepped already is served at s + 1 at once, and its
version s stays servable (`Publisher.kept`) until the commit, so a microbatch leased again is computed from it.
Each answer names the version asked for (`asked`): a worker can tell the answer to its pull from a late answer to
an earlier one (that step is over: its version is the current one, without tensors).

A worker granted shared-memory slots (`slotted`, services/aggregator/common/intake.py) gets the slot's descriptor instead of
frames: each stage's version is written once into a slot for every such worker (`SlotPublisher`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from cmemi.services.aggregator.common.outbox import Encoded
from cmemi.services.aggregator.common.publish import Publisher, SlotPublisher
from cmemi.shared.compression.downlink import DELTA, DENSE, Mirror, SentChanges
from cmemi.shared.core.fragments import PIECES
from cmemi.shared.core.fragments import encoded as encoded_pieces
from cmemi.shared.wire import protocol
from cmemi.shared.wire.layout import Layout


class SliceServer:
    def __init__(self, stages: list[dict[str, torch.Tensor]], checksum: bool, shard: int,
                 send: Callable[..., None], pipelined: bool, slotted: Callable[[bytes], bool] | None = None,
                 run: str = "", mirror: Mirror | None = None,
                 changed: Callable[[Any, int], dict[str, torch.Tensor] | None] | None = None) -> None:
        self.stages, self.shard, self.send = stages, shard, send  # each stage's pieces (live tensors)
        # compression.downlink (one stage, no slots): the stage is the mirror; a pull from one of the versions before
        # gets the change or the chain of them (encoded once per version and base), any other the whole mirror
        self.mirror, self.checksum = mirror, checksum
        self._deltas = SentChanges()
        # streaming (train.fragments): a pull from one of the F − 1 versions before gets only the pieces changed since
        # (`changed`: Trainer.changed_since), any other the whole slice
        self.changed = changed
        self.publishers = [Publisher(checksum, Layout(stage), keep_previous=pipelined) for stage in stages]
        self.slotted = slotted
        self.slots = [SlotPublisher(run, f"shard{shard}", checksum, Layout(stage)) for stage in stages] \
            if slotted is not None else []
        self.pulls: dict[bytes, tuple[int, set[int]]] = {}  # identity -> (version it waits for, stages sent)
        self.have: dict[bytes, int] = {}  # identity -> the version its mirror of this slice is at (downlink)

    def protect(self) -> None:
        """Before a step changes the pieces (Publisher.protect)."""
        for publisher in self.publishers:
            publisher.protect()

    def pull(self, identity: bytes, version: int, have: int = -1) -> None:
        self.pulls[identity] = (version, set())
        self.have[identity] = have

    def _downlink(self, identity: bytes, version: int, got: Any) -> tuple[Any, dict[str, Any]]:
        """What answers a pull of the current `version` with compression.downlink: its change, or the whole mirror."""
        assert self.mirror is not None
        have = self.have.pop(identity, -1)
        if version != self.mirror.version or (change := self.mirror.change(have)) is None:
            return got, {"downlink": DENSE}
        info, encoded = self._deltas.get(version, have,
                                         lambda: (change[0], protocol.encode_tensors(change[1], self.checksum)))
        return (encoded, None), {"downlink": DELTA, "base": have, "codec": info}

    def _pieces(self, identity: bytes, version: int, got: Any) -> tuple[Any, dict[str, Any]]:
        """Streaming: what answers a pull of the current `version`: the pieces changed since the worker's, or all."""
        assert self.changed is not None
        have = self.have.pop(identity, -1)
        if (pieces := self.changed(have, version)) is None:
            return got, {}
        encoded = self._deltas.get(version, have, lambda: encoded_pieces(pieces, self.checksum))
        return (encoded, None), {"downlink": PIECES, "base": have}

    def encoded(self, g: int, version: int) -> Encoded:
        """Stage g at `version` (its current pieces), encoded once per version."""
        return self.publishers[g].encoded(self.stages[g], version)

    def _servable(self, g: int, version: int, current: int, applied: set[int], slot: bool) -> Any:
        """Stage g at `version`, encoded (or its slot's descriptor), if this shard has it: the current step's version
        (kept when the stage was stepped already), or the next one once the stage is stepped."""
        if g in applied and version == current:
            return self.slots[g].kept(version) if slot else self.publishers[g].kept(version)
        if version != (current + 1 if g in applied else current):
            return None
        return self.slots[g].descriptor(self.stages[g], version) if slot else self.encoded(g, version)

    def answer(self, current: int, applied: set[int]) -> None:
        """Answer every waiting pull with what is here now (`current`: the step collecting; `applied`: its stages
        stepped already)."""
        for identity, (version, sent) in list(self.pulls.items()):
            if version < current:  # that step is over: the worker's lease is stale
                del self.pulls[identity]
                self.have.pop(identity, None)
                self.send(identity, "slice", (([], []), None), version=current, asked=version, shard=self.shard,
                          stage=-1)  # no tensors, but listed as none: the schema asks for the list
                continue
            slot = self.slotted is not None and self.slotted(identity)
            for g in range(len(self.stages)):
                if g not in sent and (got := self._servable(g, version, current, applied, slot)) is not None:
                    sent.add(g)
                    if slot:  # no frames: the worker reads the slot
                        self.send(identity, "slice", (([], []), None), version=version, asked=version,
                                  shard=self.shard, stage=g, shm=got)
                    elif self.mirror is not None or self.changed is not None:
                        got, fields = (self._downlink if self.mirror is not None else self._pieces)(identity, version,
                                                                                                    got)
                        self.send(identity, "slice", got, version=version, asked=version, shard=self.shard, stage=g,
                                  **fields)
                    else:
                        self.send(identity, "slice", got, version=version, asked=version, shard=self.shard, stage=g)
            if len(sent) == len(self.stages):
                del self.pulls[identity]


    def close(self) -> None:
        for slots in self.slots:
            slots.close()
