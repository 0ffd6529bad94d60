"""The step log on disk, written through: an entry is in a segment file before its `logged` goes out, so a restarted
checkpointer reads its log back and a server's replay after that restart still finds every committed step (issue 47:
before this, the log was held in memory only, and a server that died after the checkpointer's restart and before the
next checkpoint went back to that checkpoint: 7 of the 1,000 faults of bench/results/soak.json).

- **Segments.** `RUN_DIR/steplog/seg-NNNNNNNN.log`, numbered in the order they were opened; every shard's entries go
  to the one open segment, in the order they were held. A written checkpoint closes the open segment (the next entry
  opens a new one) and deletes every segment whose entries it covers, so the disk holds the entries since about the
  checkpoint before last (`checkpoint.every_steps: 0`: the whole run's, as the log in memory held it).
- **A record.** shared/runtime/records.py's (`MAGIC | meta length (u32) | payload length (u64) | meta | payload |
  xxh3-64 of meta and payload`; a server's state spool writes the same); the meta (msgpack) names the shard, the
  step, the entry's fields and each tensor's (name, dtype, shape, bytes, offset in the payload); the payload is the landed entry's one buffer (steplog.Held: its tensors at 64-byte offsets) or
  the tensors' bytes one after another. One `pwritev` per record at the segment's end.
- **Durability.** The write reaches the page cache before the ack, which is what a process's death needs: SIGKILL
  loses nothing the kernel took. No fsync: a host's death (power, kernel) can lose the tail not yet written back
  (about 30 s of entries with Linux's default dirty_expire), and the servers then find a shorter log — a double fault,
  whose steps are redone from the last checkpoint, as before this file. What an fsync per entry would cost instead is
  measured by `bench/steplog_landing.py --fsync` (docs/design/step-log.md).
- **Read back** (`recover`) at the checkpointer's start: every segment in order, each record's length and checksum
  checked as it is read (a MiB at a time: the log is never in memory whole). The first record that is cut short
  (`torn`: the process died inside its write) or fails its checksum (`corrupt`) ends its segment: the file is cut
  there and what was cut is counted, never raised. The records become `Stored` tensors, read only for a replay.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgpack
import torch
import xxhash
from cmemi.shared.runtime import records
from cmemi.shared.runtime.records import Buffer
from cmemi.shared.wire.protocol import DTYPES

FULL = (errno.ENOSPC, errno.EDQUOT)
Placed = tuple[str, str, tuple[int, ...], int, int]  # a tensor in a record: name, dtype, shape, bytes, payload offset


class Source(Protocol):
    """A record's payload read a chunk at a time (`LogFiles.append_from`)."""

    placed: list[Placed]
    nbytes: int

    def chunks(self) -> Iterator[Buffer]: ...

    def finish(self) -> None: ...


class Segment:
    """One segment file: appended at `end`; `last` is the newest step of any record in it (retention's test)."""

    def __init__(self, path: Path, seq: int, create: bool) -> None:
        self.path, self.seq = path, seq
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd: int | None = os.open(path, flags, 0o600)
        self.end = os.fstat(self.fd).st_size
        self.last = 0

    def pread(self, nbytes: int, offset: int) -> bytes:
        assert self.fd is not None, "a step log segment read after it was deleted"
        return os.pread(self.fd, nbytes, offset)

    def delete(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.path.unlink(missing_ok=True)


@dataclass(slots=True, eq=False)
class Stored:
    """A logged tensor in a segment: its bytes are read back only when a replay asks for its entry. (Not frozen: a
    frozen dataclass's `__init__` took 1.3 us a tensor against 0.2, and `append` makes one per tensor per entry.)"""

    segment: Segment
    offset: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def tensor(self) -> torch.Tensor:
        if not self.nbytes:
            return torch.empty(self.shape, dtype=DTYPES[self.dtype])
        raw = bytearray(self.segment.pread(self.nbytes, self.offset))
        return torch.frombuffer(raw, dtype=DTYPES[self.dtype]).reshape(self.shape)


@dataclass
class Record:
    """An entry read back: as `add` held it, its tensors `Stored`."""

    shard: int
    step: int
    fields: dict[str, Any]
    tensors: dict[str, Stored]


@dataclass
class Recovered:
    records: list[Record] = field(default_factory=list)  # in the order they were written
    torn: int = 0  # records cut short (the process died inside a write: never acknowledged)
    corrupt: int = 0  # records that failed their checksum, or whose header is not one
    cut_bytes: int = 0  # bytes cut from the segments' ends


class LogFiles:
    """The step log's segments under `root`. `on_full(exc, attempt)`: a write found the disk full; attempt 1 makes
    room (the record is written again at the same place), attempt 2 stops the service (diskfull.py)."""

    def __init__(self, root: Path, on_full: Callable[[OSError, int], None]) -> None:
        self.root, self.on_full = Path(root), on_full
        self.root.mkdir(parents=True, exist_ok=True)
        self.segments: list[Segment] = []  # every segment on disk, oldest first; the last one open unless `closed`
        self.closed = True
        self.seq = 0  # the newest segment's number: a new one takes the next (never reused while the run lives)
        self.written = 0  # records appended by this process

    def _paths(self) -> Iterator[tuple[int, Path]]:
        for p in sorted(self.root.glob("seg-*.log")):
            try:
                yield int(p.stem[4:]), p
            except ValueError:
                continue

    def remove_all(self) -> int:
        """Delete every segment (the log is not to be read back: `checkpoint.step_log_spool: false`)."""
        n = 0
        for s in self.segments:
            s.delete()
        self.segments.clear()
        for _, p in self._paths():
            p.unlink(missing_ok=True)
            n += 1
        return n

    def _open(self) -> Segment:
        if self.closed or not self.segments:
            self.seq += 1
            self.segments.append(Segment(self.root / f"seg-{self.seq:08d}.log", self.seq, create=True))
            self.closed = False
        return self.segments[-1]

    def append(self, shard: int, step: int, fields: dict[str, Any], tensors: list[Placed],
               payload: list[Buffer]) -> dict[str, Stored]:
        """Write one entry's record at the open segment's end (opening one if a checkpoint closed the last); returns
        its tensors as `Stored`. `tensors`: (name, dtype, shape, bytes, offset in the payload); `payload`: the bytes
        they are in, in order (`Held`'s one buffer, padding and all: one copy, one checksum)."""
        seg = self._open()
        meta = msgpack.packb({"shard": shard, "step": step, "fields": fields, "tensors": tensors})  # (tuples: arrays)
        return self._placed(seg, step, tensors, len(meta), self._write(seg, records.frame(meta, payload).bufs))

    def append_from(self, shard: int, step: int, fields: dict[str, Any], source: Source) -> dict[str, Stored]:
        """`append` of a payload read a chunk at a time (`source.chunks()`: a same-host entry's slot, steplog.py's
        `Streamed`), never whole in memory here. `source.finish()` (its checksums, the slot unchanged) runs before the
        record's last bytes, its checksum, are written: a record whose bytes are not the server's is never whole on
        disk (cut here when `finish` raises; `torn` if this process dies first)."""
        seg = self._open()
        meta = msgpack.packb({"shard": shard, "step": step, "fields": fields, "tensors": source.placed})
        assert seg.fd is not None
        fd, at = seg.fd, seg.end
        try:
            for attempt in (1, 2):
                try:
                    h, n = xxhash.xxh3_64(meta), 0
                    head: list[Buffer] = [records.HEAD.pack(records.MAGIC, len(meta), source.nbytes), meta]
                    for chunk in source.chunks():  # (the head goes with the first: a small entry, one pwritev)
                        h.update(chunk)
                        n += records.write_all(fd, [*head, chunk], at + n)
                        head = []
                    n += records.write_all(fd, head, at + n) if head else 0
                    source.finish()
                    n += records.write_all(fd, [records.TAIL.pack(h.intdigest())], at + n)
                    return self._placed(seg, step, source.placed, len(meta), n)
                except OSError as exc:
                    if exc.errno not in FULL:
                        raise
                    self.on_full(exc, attempt)  # attempt 1 makes room (the record again, at the same place); 2 stops
                    if attempt == 2:
                        raise
        except BaseException:
            os.ftruncate(fd, at)
            raise
        raise AssertionError("unreachable")

    def _placed(self, seg: Segment, step: int, tensors: list[Placed], meta_len: int, n: int) -> dict[str, Stored]:
        """A record of `n` bytes written at the segment's end: its tensors as `Stored`, the segment's end moved."""
        at = seg.end + records.HEAD.size + meta_len
        out = {name: Stored(seg, at + off, dtype, shape, nbytes) for name, dtype, shape, nbytes, off in tensors}
        seg.end += n
        seg.last = max(seg.last, step)
        self.written += 1
        return out

    def _write(self, seg: Segment, bufs: list[Buffer]) -> int:
        """A record at the segment's end; a full disk is made room on once (the record written again in place)."""
        assert seg.fd is not None
        for attempt in (1, 2):
            try:
                return records.write_all(seg.fd, bufs, seg.end)
            except OSError as exc:
                if exc.errno not in FULL:
                    raise
                self.on_full(exc, attempt)  # attempt 2: stops the service
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def covered(self, step: int) -> int:
        """A checkpoint of `step` is written: the open segment is closed (the next entry opens a new one) and every
        segment whose entries are all at or before `step` is deleted; returns how many were."""
        self.closed = True
        gone = [s for s in self.segments if s.last <= step]
        for s in gone:
            s.delete()
        self.segments = [s for s in self.segments if s.last > step]
        return len(gone)

    def recover(self) -> Recovered:
        """Every record on disk, in order, each checked; a segment's first bad record and all after it are cut off
        (counted in the result). The segments stay open for the replays; new entries go to a new segment."""
        out = Recovered()
        for seq, path in self._paths():
            seg = Segment(path, seq, create=False)
            self.segments.append(seg)
            self.seq = max(self.seq, seq)
            at = 0
            while at < seg.end:
                rec, n, bad = self._read(seg, at)
                if rec is None:
                    if bad == "torn":
                        out.torn += 1
                    else:
                        out.corrupt += 1
                    out.cut_bytes += seg.end - at
                    assert seg.fd is not None
                    os.ftruncate(seg.fd, at)
                    seg.end = at
                    break
                out.records.append(rec)
                seg.last = max(seg.last, rec.step)
                at += n
        self.closed = True
        return out

    @staticmethod
    def _read(seg: Segment, at: int) -> tuple[Record | None, int, str]:
        """The record at `at`: (record, its size, "") or (None, 0, "torn" | "corrupt")."""
        found = records.check(seg.pread, at, seg.end)
        if isinstance(found, str):
            return None, 0, found
        p, plen = found.payload_at, found.payload_len
        try:
            m = msgpack.unpackb(found.meta, strict_map_key=False)
            tensors = {name: Stored(seg, p + off, dtype, tuple(shape), nbytes)
                       for name, dtype, shape, nbytes, off in m["tensors"]}
            if any(t.offset + t.nbytes > p + plen for t in tensors.values()):
                return None, 0, "corrupt"
            rec = Record(int(m["shard"]), int(m["step"]), m["fields"], tensors)
        except (ValueError, KeyError, TypeError, msgpack.UnpackException):
            return None, 0, "corrupt"
        return rec, found.size, ""

    def close(self) -> None:
        for s in self.segments:
            if s.fd is not None:
                os.close(s.fd)
                s.fd = None


def opened(root: Path, spool: bool, read_back: bool,
           on_full: Callable[[OSError, int], None]) -> tuple[LogFiles | None, int]:
    """The run's segments and how many segments a previous process left were removed. `spool`
    (`checkpoint.step_log_spool`) false: no LogFiles (the log is in memory and, past step_log_memory_mb, in spool
    files), every segment removed. `read_back` false (a new `cmemi up` of the run directory, `--resume`: not a restart
    within the run, whose servers restore the checkpoint and train on from it as before): every segment removed."""
    files = LogFiles(root, on_full)
    removed = 0 if spool and read_back else files.remove_all()
    return (files if spool else None), removed
