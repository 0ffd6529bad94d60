"""A server's state spool (`train.local_steps`, issue 48): the replicas' states a step makes current, written to this
server's own host instead of through the checkpointer's one link (docs/design/step-log.md, "The state spool").

With local steps a step's entry once carried the states it makes current (replicas.py): each a replica's inner state,
streaming its own parameters too (~2P a replica), so every segment's states converged on the checkpointer's link —
on 8 emulated hosts at 50 Mbit/s the run went 4.2x slower with the log on than off (bench/results/cluster_home.json
and cluster_home_nolog.json). Those states arrived on this server's link already; what recovers them need not
travel again. So the server (the leader, or the shard keeping replicas r mod K) appends them here before it ships
the step's entry, and the entry carries a reference instead: [segment, offset, record size, xxh3-64].

- **Segments.** `RUN_DIR/steplog/states-<shard>/st-NNNNNNNN.log`; one record per step that makes states current
  (shared/runtime/records.py's format, magic `CSS1`; meta: the step and each tensor's name, dtype, shape, bytes,
  offset, 64-byte aligned), appended with one `pwritev`. A new process opens a new segment after the newest on disk.
- **Durability.** As the checkpointer's spool (services/checkpointer/logfiles.py): the write reaches the page cache
  before the entry is sent, so a SIGKILL of this server loses nothing; no fsync, and a host's death may lose the
  spool — a double fault: the replay finds a reference it cannot read (`Lost`), stops before that step, and the
  steps after it are redone from there (replay.py says so in events.jsonl).
- **Retention.** A written checkpoint closes the open segment (`covered`); every segment whose steps are all at or
  before the checkpoint before last is deleted (the newest may be damaged: a restore then falls back one), and a
  previous process's segments go at this process's second written checkpoint (by then every step after the one
  before last was written here). `checkpoint.every_steps: 0`: the whole run's states stay, as the log's do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack
import torch
from cmemi.shared.runtime import records
from cmemi.shared.wire.protocol import DTYPE_NAMES, DTYPES

MAGIC = b"CSS1"
ALIGN = 64  # each tensor's offset in a record
OLD = -1  # the last step of a segment a previous process wrote (not read back: see the retention rule)


class Lost(Exception):
    """A referenced record is not in the spool, or not the one referenced (the host died, or the spool was removed)."""


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, not copied where it is contiguous on the CPU already (a received state's are)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


class StateSpool:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.fd: int | None = None  # the open segment (None: the next write opens one)
        self.seq = 0  # the newest segment's number
        self.end = 0  # the open segment's length
        self.last: dict[int, int] = {}  # segment -> the newest step written in it (OLD: a previous process's)
        self.saved: list[int] = []  # the checkpoints written while this process lived
        self.opened = False
        self.written_bytes = 0  # what this process appended (the bytes the entries no longer carry)

    def _open(self) -> None:
        """The directory made and read once: the segments a previous process left are kept for its replay."""
        if self.opened:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        for p in self.root.glob("st-*.log"):
            try:
                seq = int(p.stem[3:])
            except ValueError:
                continue
            self.last[seq] = OLD
            self.seq = max(self.seq, seq)
        self.opened = True

    def path(self, seq: int) -> Path:
        return self.root / f"st-{seq:08d}.log"

    def write(self, step: int, tensors: dict[str, torch.Tensor]) -> list[int]:
        """Step `step`'s states appended (to the page cache) before its entry is sent; returns the entry's reference."""
        self._open()
        if self.fd is None:
            self.seq += 1
            self.fd = os.open(self.path(self.seq), os.O_RDWR | os.O_CLOEXEC | os.O_CREAT | os.O_EXCL, 0o600)
            self.end, self.last[self.seq] = 0, OLD
        placed: list[list[Any]] = []
        payload: list[records.Buffer] = []
        off = 0
        for name, t in tensors.items():
            raw = _raw(t)
            if pad := -off % ALIGN:  # (each tensor read back in place, aligned for its dtype)
                payload.append(bytes(pad))
                off += pad
            placed.append([name, DTYPE_NAMES[t.dtype], list(t.shape), raw.nbytes, off])
            payload.append(raw)
            off += raw.nbytes
        framed = records.frame(msgpack.packb({"step": step, "tensors": placed}), payload, MAGIC)
        at = self.end
        self.end += records.write_all(self.fd, framed.bufs, at)
        self.last[self.seq] = max(self.last[self.seq], step)
        self.written_bytes += framed.size
        return [self.seq, at, framed.size, framed.xxh]

    def read(self, ref: Any, step: int) -> dict[str, torch.Tensor]:
        """The tensors of the record `ref` names, checked (its checksum, its size, its step); raises `Lost`."""
        if not (isinstance(ref, list) and len(ref) == 4 and all(type(v) is int and v >= 0 for v in ref)):
            raise Lost(f"a reference {str(ref)[:60]} that names no record")
        seq, at, size, xxh = ref
        path = self.path(seq)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise Lost(f"{path} cannot be read ({exc.strerror})") from exc
        try:
            found = records.check(lambda n, o: os.pread(fd, n, o), at, min(at + size, os.fstat(fd).st_size), MAGIC)
            if isinstance(found, str):
                raise Lost(f"the record at {path}:{at} is {found}")
            if found.size != size or found.xxh != xxh:
                raise Lost(f"the record at {path}:{at} is not the one step {step}'s entry names")
            payload = bytearray(found.payload_len)  # read straight into it (a pread's bytes would be copied again)
            if os.preadv(fd, [payload], found.payload_at) != found.payload_len:
                raise Lost(f"the record at {path}:{at} ends early")
        finally:
            os.close(fd)
        try:
            meta = msgpack.unpackb(found.meta)
            if meta["step"] != step:
                raise Lost(f"the record at {path}:{at} holds step {meta['step']}'s states, not step {step}'s")
            out = {}
            for name, dtype, shape, nbytes, off in meta["tensors"]:
                dt = DTYPES[dtype]
                flat = torch.frombuffer(payload, dtype=dt, count=nbytes // dt.itemsize, offset=off) if nbytes else \
                    torch.empty(0, dtype=dt)
                out[name] = flat.reshape(shape)
            return out
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            raise Lost(f"the record at {path}:{at} does not hold together ({exc})") from exc

    def covered(self, step: int) -> int:
        """A checkpoint of `step` is written: the open segment is closed, and the segments only the checkpoints before
        it needed are deleted; returns how many were."""
        self._close()
        self.saved.append(step)
        if len(self.saved) < 2:
            return 0
        keep_after = self.saved[-2]
        gone = [seq for seq, last in self.last.items() if last <= keep_after]
        for seq in gone:
            self.path(seq).unlink(missing_ok=True)
            del self.last[seq]
        return len(gone)

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self._close()
