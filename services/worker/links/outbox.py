"""A lease's gradient out: encoded per shard and stage, every other shard's slice pushed at once, the leader's last.

The gradient is encoded by the worker's codec (compression: its error-feedback state lives here; a worker that dies
takes its residual with it; a step asked again is encoded from the state before its first encoding,
services/worker/residual.py), one piece list per shard and pipeline stage (shared/core/grid.py). The next version is
asked of the shards first: behind the gradient on the same connection, a pull would reach a shard only once this
worker's whole slice had, too late to take a pipelined shard's first stages. The leader's slice goes on its socket
with the step's buffers and (local steps) the replica's inner state (with `train.inner_states: shards`, replica r's
goes to shard r mod K instead, beside that shard's slice); over shared-memory slots it goes into this
worker's own segment and only its descriptor travels (the leader copies it out before it answers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from cmemi.services.worker.links.inflight import InFlight
from cmemi.services.worker.links.leader import LeaderLink
from cmemi.services.worker.links.shard_links import ShardLinks
from cmemi.services.worker.residual import Rewind
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.schema import Config
from cmemi.shared.core import innerstate
from cmemi.shared.core.buffers import PREFIX
from cmemi.shared.core.grid import Partition
from cmemi.shared.memory import shm


@dataclass
class Gradient:
    """What a lease computed: one loss per microbatch (one per round, local steps), the gradient (a replica's change
    by piece, local steps), the step's buffer contribution, and whether it is finite (an fp16 overflow is not)."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor] | None
    finite: bool
    extra: dict[str, Any] = field(default_factory=dict)  # header fields of local steps (`ahead`, `inner`)
    inner: dict[str, torch.Tensor] = field(default_factory=dict)  # a replica's inner state's tensors, when shipped


class Outbox:
    def __init__(self, run: str, cfg: Config, partition: Partition, link: LeaderLink, shard_links: ShardLinks,
                 sends: InFlight, by_piece: bool) -> None:
        self.run, self.cfg, self.partition, self.link, self.shard_links = run, cfg, partition, link, shard_links
        self.sends, self.by_piece = sends, by_piece  # by_piece: local steps' changes are by piece already
        self.codec = make_codec(cfg.compression)
        self.rewind = Rewind(self.codec)  # a step asked again encodes from the residual before its first encoding
        self.slot_writer: shm.Writer | None = None  # this worker's gradients over slots (made on first use)

    def send(self, h: dict[str, Any], g: Gradient, version: int) -> None:
        """The gradient `g` of lease `h` (computed on `version`) to every shard."""
        lo, hi = h["lo"], h["hi"]
        samples = (hi - lo) * (self.cfg.train.global_batch // self.cfg.train.microbatches) * max(1, self.cfg.train.segment)
        fields = {"finite": g.finite, "term": self.link.term, "step": h["step"], "lo": lo, "hi": hi, "version": version,
                  "losses": g.losses, "n": samples, "lease": h["lease"]}  # the leader's seal: every shard checks it
        t0 = time.perf_counter()
        self.rewind.before_encoding(self.link.term, h["step"], lo, hi)
        # (an fp16 overflow sends no tensors; a replica's change is by piece already: of one fragment, streaming)
        views = (g.grads if self.by_piece else self.partition.views(g.grads)) if g.finite else {}
        encoded = [[self.codec.encode({n: views[n] for n in names if n in views}, h["step"]) if g.finite else ({}, {})
                    for names in self.partition.staged(k)] for k in range(self.partition.shards)]
        encode_s = time.perf_counter() - t0
        extra, own = dict(g.extra), {}
        if (k := innerstate.owner(lo, self.partition.shards, self.cfg.train.inner_states)) and "inner" in extra:
            own[k] = {"inner": extra.pop("inner")}  # its state to the shard that keeps it, beside that shard's slice
            encoded[k][0] = (encoded[k][0][0], {**encoded[k][0][1], **g.inner})
        self.shard_links.ask_ahead(version + 1)
        self.shard_links.push(encoded[1:], {**fields, "encode_s": encode_s}, self.sends.trackers,  # all at once
                              **({"own": own} if own else {}))
        info, frames = encoded[0][0]  # the leader's slice, one stage (pipelined: it holds no parameters)
        if g.buffers is not None:
            frames = {**frames, **{PREFIX + n: b for n, b in g.buffers.items()}}
        if not own:
            frames = {**frames, **g.inner}
        if self.link.slots:  # into this worker's slot; the leader copies it out before it answers
            if self.slot_writer is None:
                self.slot_writer = shm.Writer(self.run, "worker", shm.checksums(self.cfg.cluster.checksum))
            self.link.send("grad", tensors={}, shm=self.slot_writer.write(frames), codec=info, encode_s=encode_s,
                           **fields, **extra)
        else:
            self.link.send("grad", tensors=frames, trackers=self.sends.trackers, codec=info, encode_s=encode_s,
                           **fields, **extra)

    def close(self) -> None:
        if self.slot_writer is not None:
            self.slot_writer.close()
