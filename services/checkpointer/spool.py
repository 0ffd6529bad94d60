"""A snapshot's tensor bytes on disk as they arrive, so the checkpointer never holds a whole snapshot.

Every snapshot the checkpointer receives goes to a spool file of its own, `.tmp-spool-…` in the
checkpoints directory, through `assembly.Assembler`'s sink: each range is written at its place with
`os.pwrite` straight from the received frame (part 0's header gives every tensor's size, so each one's
place in the file is known up front); the Assembler still checks every range and each tensor's xxh3
as the bytes go by. A transfer abandoned, a snapshot dropped after it arrived, a sharded step given up
or written: its spool file is deleted. One left by a crash is a `.tmp-` leftover, removed at the next
start (store.clean_leftovers).

What the message then holds for each tensor is a `Spooled`: its dtype, shape and where its bytes are
(`Extent`s). The pieces of a tensor cut by a sharded run (contiguous runs of rows) are joined by
listing their extents in row order (`join`); store.py writes the checkpoint files from them
(safetensors_out.py).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from cmemi.shared.wire.protocol import ProtocolError

FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Extent:
    """`nbytes` bytes at `offset` of a spool file."""

    spool: Spool
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Spooled:
    """A tensor (dtype as the wire names it) whose bytes are its extents, in order."""

    dtype: str
    shape: tuple[int, ...]
    extents: tuple[Extent, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.extents)


class Spool:
    """One snapshot transfer's spool file: tensor i at offsets[i]. `on_full(exc, attempt)` is called when a write
    finds the disk full: it makes room (attempt 1; the write is tried once more) or stops the service (attempt 2)."""

    def __init__(self, root: Path, step: int, shard: int, metas: list[dict[str, Any]],
                 on_full: Callable[[OSError, int], None]) -> None:
        self.path = root / f".tmp-spool-{step:08d}-{shard}-{os.getpid()}-{time.monotonic_ns()}"
        self.on_full = on_full
        self.offsets, at = [], 0
        for m in metas:
            self.offsets.append(at)
            at += m["nbytes"]
        self.nbytes = at
        self.tensors = {m["name"]: Spooled(m["dtype"], tuple(m["shape"]), (Extent(self, off, m["nbytes"]),))
                        for m, off in zip(metas, self.offsets, strict=True)}
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    def write(self, ti: int, off: int, buf: memoryview) -> None:
        assert self.fd is not None, "a spool written after it was discarded"
        for attempt in (1, 2):
            try:
                at, view = self.offsets[ti] + off, buf
                while view.nbytes:
                    n = os.pwrite(self.fd, view, at)
                    at, view = at + n, view[n:]
                return
            except OSError as exc:
                if exc.errno not in FULL:
                    raise
                self.on_full(exc, attempt)

    def result(self) -> dict[str, Any]:
        return dict(self.tensors)

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.path.unlink(missing_ok=True)


def of_message(tensors: Mapping[str, Any]) -> dict[str, Spooled]:
    """A received snapshot's tensors as what they are: the checkpointer's sink (`Spool`) made each a Spooled, where
    protocol.Message declares the torch.Tensor every other receiver gets."""
    return cast("dict[str, Spooled]", tensors)


def spools(tensors: Mapping[str, Any]) -> set[Spool]:
    """The spool files a message's (or a checkpoint's) tensors are in."""
    return {e.spool for t in tensors.values() if isinstance(t, Spooled) for e in t.extents}


def discard(tensors: Mapping[str, Any]) -> None:
    for s in spools(tensors):
        s.discard()


def join(pieces: Mapping[str, list], tensors: Mapping[str, Spooled]) -> dict[str, Spooled]:
    """Whole tensors from pieces (shards.Partition.describe()'s map, pieces by name): a piece is a contiguous run
    of rows of its tensor, so its bytes are a contiguous run of the tensor's. Tensors not cut pass through; pieces
    that do not tile their tensor raise `ProtocolError` (the snapshots are dropped)."""
    out = dict(tensors)
    by_param: dict[str, list[tuple[int, int, str]]] = {}
    for name, (param, lo, hi) in pieces.items():
        if name != param:
            by_param.setdefault(param, []).append((int(lo), int(hi), name))
    for param, parts in by_param.items():
        if not all(name in tensors for _, _, name in parts):
            continue
        parts.sort()
        first = tensors[parts[0][2]]
        rows = 0
        for lo, hi, name in parts:
            t = tensors[name]
            if lo != rows or t.dtype != first.dtype or not t.shape or t.shape[0] != hi - lo \
                    or t.shape[1:] != first.shape[1:]:
                raise ProtocolError("bad_meta", f"the pieces of {param!r} do not fit together"[:120])
            rows = hi
        out[param] = Spooled(first.dtype, (rows, *first.shape[1:]),
                             tuple(e for _, _, name in parts for e in tensors[name].extents))
        for _, _, name in parts:
            out.pop(name)
    return out
