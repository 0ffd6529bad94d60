"""The parameters the aggregator sends out: one copy and one wire encoding per parameter version.

A small model's copy is its flat buffers (shared/wire/layout.py): one frame per dtype, which the workers
receive straight into the flat buffers their model's parameters live in.

Frames go out zero-copy, so their bytes must not change until ZeroMQ has sent them: the optimizer
steps the live parameters, never these copies. A copy's buffers are reused for a later version
(instead of a fresh allocation, whose pages the kernel must fault in on every step) only once
every send that reads them has completed, as ZeroMQ's message trackers report; a slow or
disconnected worker keeps its buffers alive, and a new set is allocated meanwhile.

Same-host workers that asked for it (shared/memory/shm.py) get no frames: `SlotPublisher` writes each version once into a
shared-memory slot, in place of the copy above, for all of them, and their `work` carries the slot's descriptor.

Pipelined (`keep_previous`), the version before the current one stays encoded (and its buffers untouched)
too: a pipelined shard steps its stages before the step is committed, and a microbatch leased again must still
be computed from it. Otherwise no copy outlives its sends: one copy of the slice in steady state.

A model too big for flat buffers, not pipelined, is not copied at all: its live tensors are encoded and sent
zero-copy (`live`), copy-on-write. Before the optimizer changes them (`protect`, a Trainer hook), a send still in
ZeroMQ's queue (a slow or dead worker's) keeps their old storage and the tensors move to a copy; otherwise the
sends are done and the step changes the tensors in place. The copy of the slice per server is gone
(docs/design.md §8); a straggler costs one copy, at the step it is late for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from cmemi.shared.memory import shm
from cmemi.shared.wire import protocol
from cmemi.shared.wire.layout import Layout


@dataclass
class _Copy:
    tensors: dict[str, torch.Tensor]
    trackers: list[zmq.MessageTracker] = field(default_factory=list)
    version: int = -1
    encoded: tuple[list[dict[str, Any]], list[Any]] | None = None
    views: dict[str, torch.Tensor] | None = None  # flat copies: each parameter's place in them

    def idle(self) -> bool:
        if all(t.done for t in self.trackers):
            self.trackers.clear()
            return True
        return False


class Publisher:
    def __init__(self, checksum: bool, layout: Layout | None = None, pool: int = 3, keep_previous: bool = False) -> None:
        self.checksum, self.keep_previous = checksum, keep_previous
        self.layout = layout if layout is not None and layout.flat else None
        self.pool = pool  # copies kept for reuse; more may exist while slow sends hold them
        self._copies: list[_Copy] = []
        self._current: _Copy | None = None
        self._previous: _Copy | None = None
        self.live = self.layout is None and not keep_previous  # sent from the live tensors, copy-on-write
        self._live: _Copy | None = None  # its `tensors` are the live ones (not a copy)

    def encoded(self, params: dict[str, torch.Tensor], version: int) -> tuple[tuple[list[dict[str, Any]], list[Any]],
                                                                              list[zmq.MessageTracker]]:
        """The wire encoding of `params` at `version` (copied, or live, and checksummed on the first call for that
        version) and the tracker list that sends of it must append to."""
        if self.live:
            if self._live is None or self._live.version != version:
                self._live = _Copy(params, version=version, encoded=protocol.encode_tensors(params, self.checksum))
            assert self._live.encoded is not None
            return self._live.encoded, self._live.trackers
        cur = self._current
        if cur is None or cur.version != version:
            self._previous = cur if self.keep_previous else None
            cur = self._take(params)
            if self.layout is not None and cur.views is None:
                cur.views = self.layout.views(cur.tensors)
            with torch.no_grad():
                for n, p in params.items():
                    (cur.views or cur.tensors)[n].copy_(p)
            cur.version = version
            cur.encoded = protocol.encode_tensors(cur.tensors, self.checksum)
            self._current = cur
        assert cur.encoded is not None
        return cur.encoded, cur.trackers

    def kept(self, version: int) -> tuple[tuple[list[dict[str, Any]], list[Any]], list[zmq.MessageTracker]] | None:
        """The encoding of `version` if it is the current or the previous one (encoded earlier), else None."""
        for c in (self._current, self._previous):
            if c is not None and c.version == version and c.encoded is not None:
                return c.encoded, c.trackers
        return None

    def protect(self) -> None:
        """The live tensors are about to change (an optimizer step): if a send of them is still queued, it keeps
        their storage and they move to a copy of it (the same tensor objects, so the optimizer is untouched)."""
        live, self._live = self._live, None  # the next version is encoded afresh
        if live is not None and not live.idle():
            with torch.no_grad():
                for t in live.tensors.values():
                    t.data = t.data.clone()

    def release(self) -> None:
        """The run is over: no version goes out again. The copies are freed once their sends let them go."""
        self._copies.clear()
        self._current = self._previous = self._live = None

    def _take(self, params: dict[str, torch.Tensor]) -> _Copy:
        for c in self._copies:
            if c is not self._previous and c.idle():
                return c
        c = _Copy(self.layout.empty() if self.layout is not None else
                  {n: torch.empty_like(p, memory_format=torch.contiguous_format) for n, p in params.items()})
        if len(self._copies) < self.pool:
            self._copies.append(c)
        return c


class SlotPublisher:
    """Each parameter version written once into a shared-memory slot (two, alternating: a worker still reading
    version v is not overwritten by v + 1; one still reading it at v + 2 sees the sequence change and asks again)."""

    def __init__(self, run: str, role: str, checksum: bool, layout: Layout | None = None) -> None:
        self.layout = layout if layout is not None and layout.flat else None
        self.writer = shm.Writer(run, role, shm.checksums(checksum))
        shm.sweep()  # what SIGKILLed processes left (this run's or an earlier run's), now rather than at a first write
        self.version = -1
        self.desc: dict[str, Any] | None = None
        self.previous: tuple[int, dict[str, Any]] | None = None  # the version before, still whole in the other slot
        # flat: one tensor entry per dtype frame, the same for every version; and each slot's parameters as views of
        # its frames, made once per (segment, slot) (rebuilt per version they cost more than the copy: slot_path.py)
        self.metas: list[dict[str, Any]] | None = None if self.layout is None else [
            {"name": self.layout.frame_name(d), "dtype": protocol.DTYPE_NAMES[d], "shape": [n],
             "nbytes": n * d.itemsize, "xxh": None} for d, n in self.layout.sizes.items()]
        self.targets: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def kept(self, version: int) -> dict[str, Any] | None:
        """The descriptor of `version` if it is the current or the previous one (written earlier), else None."""
        if self.desc is not None and self.version == version:
            return self.desc
        return self.previous[1] if self.previous is not None and self.previous[0] == version else None

    def descriptor(self, params: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """The descriptor of `params` at `version`, written on the first call for that version."""
        if self.desc is None or self.version != version:
            self.previous = (self.version, self.desc) if self.desc is not None else None
            self.desc = None  # a failed write leaves no descriptor of a half-written slot behind
            metas = self.metas if self.metas is not None else [
                {"name": n, "dtype": protocol.DTYPE_NAMES[p.dtype], "shape": list(p.shape),
                 "nbytes": p.numel() * p.element_size(), "xxh": None} for n, p in params.items()]
            slot, views = self.writer.begin(metas)
            targets: dict[str, torch.Tensor] = dict(zip((str(m["name"]) for m in metas), views, strict=True))
            if self.layout is not None:  # its flat frames, the parameters copied into their places in them
                assert self.writer.path is not None
                key = (self.writer.path.name, slot)
                if key not in self.targets:
                    self.targets = {k: v for k, v in self.targets.items() if k[0] == key[0]}  # a replaced segment's go
                    self.targets[key] = self.layout.views(targets)  # the padding stays zero (never written)
                targets = self.targets[key]
            with torch.no_grad():  # one foreach copy, not a dispatch per tensor (issue 45)
                if params:  # (a foreach call refuses an empty list: a shard that owns no piece)
                    torch._foreach_copy_([targets[n] for n in params], list(params.values()))
            self.desc = self.writer.commit(slot, metas, views)
            self.version = version
        return self.desc

    def close(self) -> None:
        """Unlink the slots' segment, and the segments whose owners were SIGKILLed and never replaced."""
        self.targets = {}  # views of the segment's map: it closes once none is left
        self.writer.close()
        shm.sweep()
