"""What the leader sends a worker with its lease (docs/design.md §2, §9, §10): the `work` message, carrying the
current parameters when the worker's are stale, in the cheapest form that worker can take —

- compression.downlink: the change (or chain of changes) since the worker's version, else the whole mirror;
- streaming (train.fragments): only the pieces changed since the worker's version;
- a same-host worker with a slot: no frames, a descriptor of the shared-memory slot it reads;
- otherwise the whole parameters, encoded once per version and sent zero-copy;

and, for local steps, a replica's inner state ahead of the work unless the worker holds it already. Where a
replica's lease goes (`placement`) follows who holds its state, so a state moves over the wire only when its
holder is gone.
"""

from __future__ import annotations

from typing import Any

import torch
from cmemi.services.aggregator.leader.parts import LeaderParts
from cmemi.shared.compression.downlink import DELTA, DENSE, SentChanges
from cmemi.shared.core import fragments as fragmenting
from cmemi.shared.core import innerstate
from cmemi.shared.memory import shm
from cmemi.shared.wire import protocol


class Handout:
    def __init__(self, parts: LeaderParts) -> None:
        self.p = parts
        self.deltas = SentChanges()  # compression.downlink, streaming: the current version's changes, encoded, by base

    def placement(self, identity: bytes, step: int) -> tuple[set[int], set[int]]:
        """Local steps: (the replicas this worker holds the state of: preferred, the replicas held by another live
        worker: avoided). Streaming, a replica another live worker holds waits for it (it may have computed it
        ahead already), never moves with its state to whoever asks first; a holder silent for a lease's timeout
        holds nothing back, and a late joiner gets its fair share."""
        holdings, p = self.p.holdings, self.p
        prefer = holdings.prefer(identity, step) | holdings.nearby(identity, step) if holdings is not None else set()
        avoid: set[int] = set()
        if holdings is not None and p.trainer.fragments:
            fair = p.leasing.pace.fair(p.live_workers)  # ⌈R / workers⌉, over those a slow host's share left
            avoid = holdings.elsewhere(identity, step, p.admission.admitted, fair, p.leasing.timeout)
        return prefer, avoid

    def note_holds(self, identity: bytes, h: dict[str, Any]) -> None:
        """Local steps: the (replica, round) inner states a worker says it holds (a `want` or `grad`)."""
        if self.p.holdings is not None:
            self.p.holdings.note(identity, h["holds"], self.p.admission.admitted, h.get("near"))

    def work(self, identity: bytes, node: tuple[int, int, bytes], held_version: int, last: bool = False) -> None:
        """Send a lease; with the current parameters (encoded once per version, sent zero-copy) if the worker's
        are stale. `last`: the worker's last lease of this step, as things stand."""
        p, trainer = self.p, self.p.trainer
        fields: dict[str, Any] = {"last": True} if last else {}
        stale = held_version != trainer.step
        if stale and trainer.mirror is not None:
            encoded = self._downlink(held_version, fields)
        elif stale and (pieces := trainer.changed_since(held_version, trainer.step)) is not None:
            encoded = self._pieces(held_version, pieces, fields)
        elif stale and p.slots is not None and identity in p.intake.granted and (wire := trainer.wire_state()):
            fields["shm"] = p.slots.descriptor(wire, trainer.step)  # no frames: the worker reads the slot
            if p.slots.layout is not None:
                fields["layout"] = p.layout.digest
            encoded = (([], []), None)
        elif stale:
            encoded = p.publisher.encoded(trainer.wire_state(), trainer.step)
            if p.publisher.layout is not None:
                fields["layout"] = p.layout.digest
        else:
            encoded = (([], []), None)  # a work message always lists its tensors, here none
        if trainer.inner is not None:
            self._inner(identity, node[0])
        if p.roster is not None and (placed := p.roster.news(identity)) is not None:
            fields["shards"] = placed  # a shard restarted in the term: where it is now, before any slice goes to it
        n = p.outbox.send(identity, "work", encoded, term=p.term, step=p.leasing.collector.step, lo=node[0],
                          hi=node[1], lease=node[2], version=trainer.step, scale=trainer.scaler.scale, **fields)
        p.totals.duplicate_param_sends += p.leasing.sent(identity, trainer.step if stale else None)
        p.totals.sent(fields)
        slotted = shm.payload_bytes(fields["shm"]) if "shm" in fields else 0  # counted as the socket's would be
        p.totals.slot_out += slotted
        p.reporter.work_bytes(n + slotted)

    def _inner(self, identity: bytes, r: int) -> None:
        """Local steps: replica r's inner state at the start of this round, ahead of its work, unless the worker holds
        it (it computed the replica's last round: docs/design.md §10). A replica another shard keeps: its state comes
        from there, and with train.state_every > 1 only the leader's pieces of the versions its replay needs from here
        (`only_past`; every shard k > 0's, the worker pulls: services/worker/links/shard_links.py `past`)."""
        p, inner = self.p, self.p.trainer.inner
        step = p.trainer.step
        assert inner is not None and p.holdings is not None
        if p.holdings.has(identity, r, step):
            return
        if not inner.owns(r):  # (another shard's: the worker asks it)
            if p.trainer.history.on and (got := self._past(r)) is not None and got[0] < step:
                n = p.outbox.send(identity, "inner", (protocol.encode_tensors(got[1], p.cfg.cluster.checksum), None),
                                  replica=r, round=got[0], meta={}, only_past=True)
                p.reporter.work_bytes(n)
            return
        meta, tensors = inner.wire(r)
        p.totals.inner_states_sent += bool(meta)  # (a fresh one, round 0's, is an empty map)
        if p.trainer.fragments:  # streaming: the snapshot's own segment (the worker computes the ones since again)
            step = (inner.start(r) or {}).get("start", 0)
        elif p.trainer.history.on:  # train.state_every > 1: the snapshot's round, and the versions its replay needs
            if (got := self._past(r)) is None:
                return
            step = got[0]
            p.totals.replayed(p.ctx.emit, r, step, p.trainer.step)  # the rounds its new holder computes again
            tensors = {**tensors, **got[1]}
        n = p.outbox.send(identity, "inner", (protocol.encode_tensors(tensors, p.cfg.cluster.checksum), None),
                          replica=r, round=step, meta=meta)
        p.reporter.work_bytes(n)

    def _past(self, r: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """train.state_every > 1: (the round s replica r's snapshot starts, the leader's pieces of versions s … t − 1,
        named for an `inner` message); None, logged, if one is not in the history."""
        p = self.p
        first, past = innerstate.snapshot_start(p.trainer.step, r, p.cfg.train.state_every), {}
        for u in range(first, p.trainer.step):
            pieces, why = p.trainer.history.get(u)
            if pieces is None:  # (not by construction: the window covers every current snapshot)
                p.ctx.log.error("cannot send a moved replica's past version", replica=r, version=u, reason=why)
                return None
            past.update(innerstate.past_tensors(u, pieces))
        return first, past

    def _downlink(self, held_version: int, fields: dict[str, Any]) -> Any:
        """compression.downlink: the change (or the chain of them) from the worker's version to the current one when
        the mirror kept them (encoded once per version and base, with the step's buffers as they are), else the whole
        mirror (docs/design.md §9)."""
        p = self.p
        mirror, step = p.trainer.mirror, p.trainer.step
        assert mirror is not None
        if (change := mirror.change(held_version)) is None:
            fields["downlink"] = DENSE
            if p.publisher.layout is not None:
                fields["layout"] = p.layout.digest
            return p.publisher.encoded(p.trainer.wire_state(), step)

        def encode() -> tuple[Any, Any]:
            buffers = {k: b.clone() for k, b in p.trainer.wire_buffers().items()}  # folded in place next step
            return change[0], protocol.encode_tensors({**change[1], **buffers}, p.cfg.cluster.checksum)
        info, encoded = self.deltas.get(step, held_version, encode)
        fields.update(downlink=DELTA, base=held_version, codec=info)
        return (encoded, None)

    def _pieces(self, held_version: int, pieces: dict[str, torch.Tensor], fields: dict[str, Any]) -> Any:
        """Streaming: only the pieces the steps since the worker's version changed (its fragments: P / F a step, not
        P), and the step's buffers; copied, as the next step changes them in place, once per version and base."""
        fields.update(downlink=fragmenting.PIECES, base=held_version)
        return (self.deltas.get(self.p.trainer.step, held_version,
                                lambda: fragmenting.encoded(pieces, self.p.cfg.cluster.checksum)), None)
