"""Checksummed records appended to a file: the step log's segments (services/checkpointer/logfiles.py) and a
server's state spool (services/aggregator/steplog/statespool.py) write and check them the same way.

A record is `MAGIC | meta length (u32) | payload length (u64) | meta | payload | xxh3-64 of meta and payload`: the
meta is msgpack (what the payload holds, each user's own), the payload the tensors' bytes. One `pwritev` per record
at the file's end, so a process's death leaves a record whole or cut short, never interleaved; a reader tells the
two apart (`check`): cut short (`torn`: the process died inside its write, never acknowledged) or failing its
checksum or magic (`corrupt`). Lives in shared/ because services never import each other: both services' files
are one format with one reader.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

MAGIC = b"CSL1"
HEAD = struct.Struct("<4sIQ")  # magic, meta length, payload length
TAIL = struct.Struct("<Q")  # xxh3-64 of meta + payload
CHUNK = 1 << 20  # bytes read at a time when a record's checksum is checked (a record is never in memory whole)
IOV_GROUP = 512  # buffers per pwritev (Linux takes at most IOV_MAX, 1024)
Buffer = bytes | memoryview


@dataclass(frozen=True)
class Framed:
    """A record ready to write: its buffers in order, its size and its checksum (which a reference may carry)."""

    bufs: list[Buffer]
    size: int
    xxh: int


@dataclass(frozen=True)
class Found:
    """A record read and checked at `at`: its meta's bytes, where its payload starts, its length, the record's size
    and checksum."""

    meta: bytes
    payload_at: int
    payload_len: int
    size: int
    xxh: int


def frame(meta: bytes, payload: list[Buffer], magic: bytes = MAGIC) -> Framed:
    """`meta` and `payload` as one record's buffers (the payload not copied)."""
    h = xxhash.xxh3_64(meta)
    size = 0
    for b in payload:
        h.update(b)
        size += memoryview(b).nbytes
    xxh = h.intdigest()
    return Framed([HEAD.pack(magic, len(meta), size), meta, *payload, TAIL.pack(xxh)],
                  HEAD.size + len(meta) + size + TAIL.size, xxh)


def write_all(fd: int, bufs: list[Buffer], at: int) -> int:
    """Every buffer written at `at`, in order, returns the bytes written: `pwritev` in groups of IOV_GROUP buffers,
    and what a short write (a signal, a nearly full disk) left, one buffer at a time."""
    done = 0
    for g in range(0, len(bufs), IOV_GROUP):
        group = [memoryview(b).cast("B") for b in bufs[g:g + IOV_GROUP]]
        n = os.pwritev(fd, group, at + done)
        want = sum(v.nbytes for v in group)
        done += n
        if n < want:
            skip = n
            for view in group:
                if skip >= view.nbytes:
                    skip -= view.nbytes
                    continue
                view, skip = view[skip:], 0
                while view.nbytes:
                    k = os.pwrite(fd, view, at + done)
                    done, view = done + k, view[k:]
    return done


def check(pread: Callable[[int, int], bytes], at: int, end: int, magic: bytes = MAGIC) -> Found | str:
    """The record at `at` of a file `end` bytes long, its checksum checked a CHUNK at a time (`pread(n, offset)`):
    `Found`, or "torn" (cut short) or "corrupt" (not a record's header, or its checksum fails)."""
    left = end - at
    if left < HEAD.size + TAIL.size:
        return "torn"
    got, mlen, plen = HEAD.unpack(pread(HEAD.size, at))
    if got != magic:
        return "corrupt"
    size = HEAD.size + mlen + plen + TAIL.size
    if size > left:
        return "torn"
    meta = pread(mlen, at + HEAD.size)
    h = xxhash.xxh3_64(meta)
    p = at + HEAD.size + mlen
    for off in range(0, plen, CHUNK):
        h.update(pread(min(CHUNK, plen - off), p + off))
    (want,) = TAIL.unpack(pread(TAIL.size, p + plen))
    if h.intdigest() != want:
        return "corrupt"
    return Found(meta, p, plen, size, want)
