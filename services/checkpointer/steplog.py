"""The step log: each committed step's inputs, held here until a checkpoint covers them (docs/design.md §11).

A parameter server ships every step's reduced gradient slice (after reduction, before its optimizer), the step's
decisions (a skipped step, the loss) and its buffer sum, and counts the step committed only once this process has
acknowledged it (`logged`). A restarted server restores the checkpoint and asks for the entries after it
(`log_req`, two ahead: services/aggregator/steplog/link.py), and replays them through its optimizer: no worker recomputes a committed step.

- The log of a server is a contiguous run of steps `base + 1 .. last`, `base` the newest checkpoint's step (0: none,
  a fresh run's state is a pure function of the config). An entry that would leave a gap (this checkpointer restarted
  and lost what it held) is answered `log_gap`: the server then takes a checkpoint at once, which rebases the log.
- A written checkpoint drops the entries it covers. A `log_req` is the current term's server restarting: if it
  restored a checkpoint older than the log's base (the newest was damaged), the log starts again there.
- Memory: entries are held as tensors while they total under checkpoint.step_log_memory_mb; past it, only on disk
  (they arrive into a spool file, spool.py, and are then kept only in the log's segment: read back for a replay);
  a same-host entry with the spool on, never (`Streamed`).
- Disk (logfiles.py, `checkpoint.step_log_spool`, on by default): every entry `add` holds is written through to a
  segment file before it is acknowledged, and a restarted checkpointer reads the log back (`recover`): a server's
  replay after that restart finds every committed step. Off, a restart of this process loses the log: the servers
  take a checkpoint at once (`log_gap`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from cmemi.services.checkpointer import spool
from cmemi.services.checkpointer.logfiles import Buffer, LogFiles, Placed, Stored
from cmemi.shared.memory.shm import ShmError
from cmemi.shared.wire.protocol import DTYPE_NAMES, DTYPES, tensor_bytes

ALIGN = 64  # each tensor's offset in an entry's buffer (as in a shared-memory slot): a view of any dtype is aligned
SLOTS_KEPT = 4  # slot layouts whose byte views `SlotBytes` keeps (a server's two slots, a skipped step's layout)


@dataclass
class Piece:
    """A held tensor not viewed as one yet: a range of its entry's buffer. Only a replay reads an entry (`loaded`),
    so landing one makes no tensor views: a torch call per tensor on a thread just woken cost more than the copy."""
    flat: torch.Tensor
    at: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def tensor(self) -> torch.Tensor:
        return self.flat[self.at:self.at + self.nbytes].view(DTYPES[self.dtype]).reshape(self.shape)

    def raw(self) -> np.ndarray:
        return self.flat.numpy()[self.at:self.at + self.nbytes]


class Streamed(dict[str, Any]):
    """A same-host entry with the spool on, still in the server's slot (`data`; its tensors at `at`): `StepLog.add`
    writes it into the log's segment from the slot a chunk at a time (`LogFiles.append_from`), `unmap` dropping each
    chunk's pages from this process once written, the checksums taken over the chunks and the slot checked unchanged
    (`finish`) before the record is whole; the log keeps only its place. Nothing of it is held here (the dict is
    empty): a landing buffer and the server's slots left mapped were the checkpointer's peak (issue 47)."""

    def __init__(self, metas: list[dict[str, Any]], at: list[int], data: memoryview, chunk: int,
                 unmap: Callable[[int, int], None], intact: Callable[[], bool]) -> None:
        super().__init__()
        self.metas, self.at, self.data, self.chunk = metas, at, data, max(1, chunk)
        self.unmap, self.intact = unmap, intact
        self.placed: list[Placed] = [(m["name"], m["dtype"], tuple(m["shape"]), m["nbytes"], a)
                                     for m, a in zip(metas, at, strict=True)]
        self.nbytes = max((a + m["nbytes"] for m, a in zip(metas, at, strict=True)), default=0)
        self.hashes: list[Any] = []

    def chunks(self) -> Iterator[memoryview]:
        """The payload (the slot's bytes up to its last tensor's end), a chunk at a time."""
        self.hashes = [xxhash.xxh3_64() if m["xxh"] is not None else None for m in self.metas]
        for lo in range(0, self.nbytes, self.chunk):
            hi = min(self.nbytes, lo + self.chunk)
            for h, m, a in zip(self.hashes, self.metas, self.at, strict=True):
                if h is not None and a < hi and lo < a + m["nbytes"]:
                    h.update(self.data[max(a, lo):min(a + m["nbytes"], hi)])
            yield self.data[lo:hi]
            if self.nbytes > self.chunk:  # (an entry of one chunk stays mapped: a chunk, and no syscall per entry)
                self.unmap(max(0, lo - self.chunk), hi)  # (and the chunk before: a read fault maps pages around it)

    def finish(self) -> None:
        """Every tensor's checksum (where the server sent one) matches, and the slot was not written meanwhile."""
        for h, m in zip(self.hashes, self.metas, strict=False):
            if h is not None and h.intdigest() != m["xxh"]:
                raise ShmError("bad_checksum", repr(m["name"])[:60])
        if not self.intact():
            raise ShmError("shm_overwritten", "a step log entry's slot was written while read")


class SlotBytes:
    """The byte views (numpy) of a same-host server's slot views, made once per slot and layout: shm_reader.Reader
    hands out the same view objects for the same slot and layout, so each entry's copy is one numpy memcpy per
    tensor (the spool off: `Held.fill`). Kept for a few slots only (a new segment, or more layouts than that, clears
    them: no old mapping pinned)."""

    def __init__(self) -> None:
        self.kept: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[np.ndarray]]] = {}

    def of(self, desc: dict[str, Any], views: dict[str, torch.Tensor]) -> list[np.ndarray]:
        """The bytes of each of `desc`'s tensors (`views`, from the reader), in the descriptor's order."""
        names = [m["name"] for m in desc["tensors"]]
        key = (desc["seg"], desc["slot"], tuple(desc["at"]), tuple(names))
        hit = self.kept.get(key)
        if hit is not None and all(v is views[n] for v, n in zip(hit[0], names, strict=True)):
            return hit[1]
        if len(self.kept) >= SLOTS_KEPT or any(k[0] != desc["seg"] for k in self.kept):
            self.kept.clear()
        ts = [views[n] for n in names]
        raw = [np.frombuffer(tensor_bytes(t), dtype=np.uint8) if t.numel() else np.empty(0, np.uint8) for t in ts]
        self.kept[key] = (ts, raw)
        return raw


class Held:
    """An entry's tensor bytes in memory (the Assembler's sink: each range written at its place as it arrives), in one
    buffer, its tensors at ALIGN offsets: landing an entry is one allocation, not one per tensor. In a cnn1d run (6
    small tensors, checkpoint.every_steps: 0, a loaded 2-core machine), the step log thread spent about 110 us of
    CPU per entry making the sink (a `torch.empty` per tensor) and 30 us copying into it, measured with
    thread_time around each part; the one buffer, `Piece`s and `fill`'s numpy copies are the cut (issue 45):
    bench/steplog_landing.py's cnn1d entry lands in 17-19 us of CPU against 55-62 us before it."""

    def __init__(self, metas: list[dict[str, Any]]) -> None:
        self.starts = self.starts_of(metas)
        self.flat = torch.empty(self.size(metas), dtype=torch.uint8)
        self.bytes = self.flat.numpy()
        self.metas: list[dict[str, Any]] | None = metas

    def write(self, ti: int, off: int, buf: memoryview) -> None:
        at = self.starts[ti] + off
        self.bytes[at:at + buf.nbytes] = np.frombuffer(buf, dtype=np.uint8)

    def fill(self, raw: list[np.ndarray]) -> None:
        """Every tensor's bytes copied from `raw` (`SlotBytes.of` a same-host entry's slot, in the metas' order)."""
        for m, a, src in zip(self.metas or (), self.starts, raw, strict=False):
            if m["nbytes"]:
                self.bytes[a:a + m["nbytes"]] = src

    def pieces(self) -> dict[str, Any]:
        """The entry as the log holds it (`Piece`s: no tensor views made)."""
        return {m["name"]: Piece(self.flat, a, m["dtype"], tuple(m["shape"]), m["nbytes"])
                for m, a in zip(self.metas or (), self.starts, strict=False)}

    @staticmethod
    def starts_of(metas: list[dict[str, Any]]) -> list[int]:
        """Each tensor's offset in an entry's one buffer (ALIGN multiples)."""
        starts, end = [], 0
        for m in metas:
            starts.append(end)
            end += (m["nbytes"] + ALIGN - 1) // ALIGN * ALIGN
        return starts

    @staticmethod
    def size(metas: list[dict[str, Any]]) -> int:
        """The bytes an entry of `metas` takes in one buffer (each tensor at an ALIGN offset)."""
        return sum((m["nbytes"] + ALIGN - 1) // ALIGN * ALIGN for m in metas)

    def result(self) -> dict[str, Any]:
        return {n: p.tensor() for n, p in self.pieces().items()}

    def discard(self) -> None:
        self.metas = None


def _read(t: spool.Spooled) -> torch.Tensor:
    """A spooled tensor back in memory (for a replay: the log past its memory bound)."""
    out = bytearray(t.nbytes)
    at = 0
    for e in t.extents:
        assert e.spool.fd is not None, "a spooled log entry read after it was discarded"
        chunk = os.pread(e.spool.fd, e.nbytes, e.offset)
        out[at:at + len(chunk)] = chunk
        at += e.nbytes
    return torch.frombuffer(out, dtype=DTYPES[t.dtype]).reshape(t.shape) if out else \
        torch.empty(t.shape, dtype=DTYPES[t.dtype])


@dataclass
class Entry:
    fields: dict[str, Any]  # step, skip, loss, partials, extra: as the server sent them
    # torch.Tensor or Piece (held); logfiles.Stored (past the memory bound, or read back after a restart); or
    # spool.Spooled (past the bound with checkpoint.step_log_spool false: no segment to keep it in)
    tensors: dict[str, Any]
    nbytes: int  # of the tensors held in memory (0: on disk)

    def loaded(self) -> dict[str, torch.Tensor]:
        return {n: _read(t) if isinstance(t, spool.Spooled) else t.tensor() if isinstance(t, Piece | Stored) else t
                for n, t in self.tensors.items()}


def _placed(tensors: dict[str, Any]) -> tuple[list[Placed], list[Buffer]]:
    """An entry's tensors as logfiles.LogFiles.append takes them. A landed entry's `Piece`s share one buffer, which
    goes as it is: one buffer, one checksum pass, one bytes view, where a view per tensor was most of the write's CPU
    for cnn1d's six small tensors (bench/steplog_landing.py)."""
    ts = list(tensors.values())
    if ts and all(isinstance(t, Piece) and t.flat is ts[0].flat for t in ts):
        return [(n, t.dtype, t.shape, t.nbytes, t.at) for n, t in tensors.items()], [ts[0].flat.numpy().data]
    placed: list[Placed] = []
    bufs: list[Buffer] = []
    at = 0
    for n, t in tensors.items():
        if isinstance(t, Piece):
            b, dtype, shape = t.raw().data, t.dtype, t.shape
        elif isinstance(t, spool.Spooled):
            b, dtype, shape = tensor_bytes(_read(t)), t.dtype, t.shape
        else:
            b, dtype, shape = tensor_bytes(t.contiguous()), DTYPE_NAMES[t.dtype], tuple(t.shape)
        placed.append((n, dtype, shape, b.nbytes, at))
        bufs.append(b)
        at += b.nbytes
    return placed, bufs


@dataclass
class ShardLog:
    base: int  # the newest checkpoint's step: the log holds base + 1 .. last
    entries: dict[int, Entry] = field(default_factory=dict)

    @property
    def last(self) -> int:
        """base + the entries held: they are always the contiguous run base + 1 .. last (`add` takes only last + 1;
        `covered` and `truncate` cut at either end). `max(entries)` was O(entries) on every entry: 7 % of the step
        log thread's samples at 3000 entries (py-spy record, a cnn1d run with checkpoint.every_steps: 0)."""
        return self.base + len(self.entries)


class StepLog:
    """Every server's log (one per shard), bounded in memory by `memory_bytes`; `spill(header, metas)` makes a
    spool file for an entry past the bound."""

    def __init__(self, base: int, memory_bytes: int, spill: Callable[[dict, list[dict]], spool.Spool],
                 files: LogFiles | None = None) -> None:
        """`files`: the log's segments on disk, written through (none: held in memory and spool files only)."""
        self.base, self.memory_bytes, self.spill, self.files = base, memory_bytes, spill, files
        self.logs: dict[int, ShardLog] = {}
        self.in_memory = 0  # bytes of entries held as tensors
        self.spilled = 0  # entries ever spooled to disk (the bound passed)

    def sink(self, header: dict[str, Any], metas: list[dict[str, Any]]) -> Held | spool.Spool:
        """Where an arriving entry's bytes go: memory, or a spool file past the bound."""
        nbytes = sum(m["nbytes"] for m in metas)
        if self.in_memory + nbytes <= self.memory_bytes:
            return Held(metas)
        self.spilled += 1
        return self.spill(header, metas)

    def _log(self, shard: int) -> ShardLog:
        return self.logs.setdefault(shard, ShardLog(self.base))

    def add(self, shard: int, fields: dict[str, Any], tensors: dict[str, Any]) -> bool:
        """Hold a step's entry; False (and nothing held) if it would leave a gap after what is held."""
        log, step = self._log(shard), int(fields["step"])
        if step <= log.base or step in log.entries:  # covered by a checkpoint, or sent again: held already
            self._drop(tensors)
            return True
        if step != log.last + 1:
            self._drop(tensors)
            return False
        if isinstance(tensors, Streamed) and self.files is not None:  # (same host, the spool on: its record alone)
            log.entries[step] = Entry(fields, self.files.append_from(shard, step, fields, tensors), 0)
            return True
        held = not any(isinstance(t, spool.Spooled) for t in tensors.values())
        nbytes = sum(int(t.nbytes) for t in tensors.values())
        if self.files is not None:  # on disk before the ack (the caller's `logged`)
            stored = self.files.append(shard, step, fields, *_placed(tensors))
            if not held:  # past the memory bound: the segment is its one copy on disk
                self._drop(tensors)
                tensors = dict(stored)
        log.entries[step] = Entry(fields, tensors, nbytes if held else 0)
        self.in_memory += log.entries[step].nbytes
        return True

    def base_of(self, shard: int) -> int:
        return self._log(shard).base

    def holds(self, shard: int, step: int) -> bool:
        """Is `step` of `shard` held (its entry, or covered by the checkpoint the log starts at)?"""
        log = self._log(shard)
        return step <= log.base or step in log.entries

    def truncate(self, after: int) -> None:
        """Every entry past `after` goes (sharded: the leader replayed to `after`, the end of the steps every shard's
        log holds; what lies past it was never committed, and the new term computes those steps again)."""
        for log in self.logs.values():
            for s in [s for s in log.entries if s > after]:
                self._forget(log, s)

    def covered(self, step: int) -> None:
        """A checkpoint of `step` is written: the entries up to it go, and the segments that held only those."""
        self.base = max(self.base, step)
        for log in self.logs.values():
            for s in [s for s in log.entries if s <= step]:
                self._forget(log, s)
            log.base = max(log.base, step)
        if self.files is not None:
            self.files.covered(step)

    def recover(self) -> dict[str, int]:
        """The log read back from its segments (a restarted checkpointer, before it serves anything), in the order its
        entries were held: each shard's contiguous run after `base`. A record of a step the log already holds
        replaces it and what followed (the live log had cut them: `truncate`); one after a gap (a record cut before
        it) is dropped. Returns counts: entries held, records `torn` (never acknowledged), `corrupt` and `dropped`
        (`lost`: acknowledged entries the log no longer has, the double fault of docs/design/step-log.md)."""
        assert self.files is not None, "recover() needs the log's files"
        got, dropped = self.files.recover(), 0
        for r in got.records:
            log = self._log(r.shard)
            if r.step <= log.base:
                continue
            for s in [s for s in log.entries if s >= r.step]:
                self._forget(log, s)
            if r.step != log.last + 1:
                dropped += 1
                continue
            log.entries[r.step] = Entry(r.fields, dict(r.tensors), 0)
        self.files.covered(self.base)  # segments only of steps the newest checkpoint holds
        return {"entries": sum(len(log.entries) for log in self.logs.values()), "torn": got.torn,
                "corrupt": got.corrupt, "dropped": dropped, "lost": got.corrupt + dropped, "cut_bytes": got.cut_bytes}

    def restart_at(self, shard: int, after: int) -> None:
        """A server of the current term restored step `after` and replays from there. Restored from a checkpoint
        older than the log's base (the newest was damaged), it cannot replay what the log holds (the steps between
        are in no entry): the log starts again at `after`, and the steps since are redone."""
        log = self._log(shard)
        if after < log.base:
            for old in list(log.entries):
                self._forget(log, old)
            log.base = after

    def entry(self, shard: int, step: int) -> Entry | None:
        return self._log(shard).entries.get(step)

    def _forget(self, log: ShardLog, step: int) -> None:
        e = log.entries.pop(step)
        self.in_memory -= e.nbytes
        self._drop(e.tensors)

    @staticmethod
    def _drop(tensors: dict[str, Any]) -> None:
        spool.discard(tensors)

    def clear(self) -> None:
        for log in self.logs.values():
            for s in list(log.entries):
                self._forget(log, s)
