"""A shard's answers to workers' pulls: each stage of its slice at the version asked for, as soon as it has it.

Version s is served while step s collects; pipelined, a stage stepped already is served at s + 1 at once, and its
version s stays servable (`Publisher.kept`) until the commit, so a microbatch leased again is computed from it.
Each answer names the version asked for (`asked`): a worker can tell the answer to its pull from a late answer to
an earlier one (that step is over: its version is the current one, without tensors).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from cmemi.services.aggregator.outbox import Encoded
from cmemi.services.aggregator.publish import Publisher
from cmemi.shared.layout import Layout


class SliceServer:
    def __init__(self, stages: list[dict[str, torch.Tensor]], checksum: bool, shard: int,
                 send: Callable[..., None], pipelined: bool) -> None:
        self.stages, self.shard, self.send = stages, shard, send  # each stage's pieces (live tensors)
        self.publishers = [Publisher(checksum, Layout(stage), keep_previous=pipelined) for stage in stages]
        self.pulls: dict[bytes, tuple[int, set[int]]] = {}  # identity -> (version it waits for, stages sent)

    def protect(self) -> None:
        """Before a step changes the pieces (Publisher.protect)."""
        for publisher in self.publishers:
            publisher.protect()

    def pull(self, identity: bytes, version: int) -> None:
        self.pulls[identity] = (version, set())

    def encoded(self, g: int, version: int) -> Encoded:
        """Stage g at `version` (its current pieces), encoded once per version."""
        return self.publishers[g].encoded(self.stages[g], version)

    def _servable(self, g: int, version: int, current: int, applied: set[int]) -> Encoded | None:
        """Stage g at `version`, encoded, if this shard has it: the current step's version (kept when the stage
        was stepped already), or the next one once the stage is stepped."""
        if g not in applied:
            return self.encoded(g, version) if version == current else None
        if version == current:
            return self.publishers[g].kept(version)
        return self.encoded(g, version) if version == current + 1 else None

    def answer(self, current: int, applied: set[int]) -> None:
        """Answer every waiting pull with what is here now (`current`: the step collecting; `applied`: its stages
        stepped already)."""
        for identity, (version, sent) in list(self.pulls.items()):
            if version < current:  # that step is over: the worker's lease is stale
                del self.pulls[identity]
                self.send(identity, "slice", (([], []), None), version=current, asked=version, shard=self.shard,
                          stage=-1)  # no tensors, but listed as none: the schema asks for the list
                continue
            for g in range(len(self.stages)):
                if g not in sent and (encoded := self._servable(g, version, current, applied)) is not None:
                    sent.add(g)
                    self.send(identity, "slice", encoded, version=version, asked=version, shard=self.shard, stage=g)
            if len(sent) == len(self.stages):
                del self.pulls[identity]

