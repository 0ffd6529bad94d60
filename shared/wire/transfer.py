"""Logical messages bigger than `cluster.max_message_bytes` travel as several ZeroMQ messages ("parts"): sending.

A message that fits goes out exactly as `protocol.encode` builds it (one ZeroMQ message, no copy). A
bigger one (a gradient, parameters, a snapshot or a restore of a big model) is cut on a chunk grid
(docs/design.md §3): each tensor into chunks of `chunk` bytes (CHUNK = 4 MiB, or less when the cap is
smaller: what fits in one part beside its header), the last one shorter; one frame per chunk; a part
carries a run of whole chunks and is at most the cap, header included. Each part's header is a
`part` message: the transfer id `xfer`, `index` and `count`, and per frame `[tensor, offset, nbytes]`;
part 0 also carries the logical header (`of`, validated like any header, with its tensor entries and
their whole-tensor checksums). Chunks go in order, tensor by tensor, so the receiver (assembly.py)
checks every range against one cursor.

A sender whose logical header alone leaves no room for a chunk under the cap raises `TooBig` (the
services stop with its one line, exit 2); it never sends a message over the cap, since libzmq drops a
peer whose frame exceeds MAXMSGSIZE before the receiver could say why.

A sender whose tensors are not in memory (the checkpointer's restore, read from its files) uses
`stream`: the same messages, each one's bytes read just before it is sent, at most two held.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import msgpack
import torch
import zmq
from cmemi.shared.errors import WireError
from cmemi.shared.wire import protocol
from cmemi.shared.wire.header import PROTOCOL_VERSION

CHUNK = 4 << 20  # bytes; a multiple of 64 (docs/design.md §3)
# The part size of the big messages whose receivers bound what they queue (RCVHWM) or whose senders copy each
# part as it goes: gradients, snapshots. Two chunks: a queued part costs 8 MiB, not the cap (docs/design.md §8).
PART = 2 * CHUNK
ALIGN = 64
_ENTRY = 24  # msgpack bound of one [tensor, offset, nbytes] entry (fixarray + three ints below 2^32 / 2^64)
_BIG = 1 << 32  # stands in for index and count when bounding a part header


class TooBig(WireError):
    """The logical header alone leaves no room for a chunk under the cap."""


def messages(mtype: str, run: str, fields: dict[str, Any], cap: int, tensors: dict[str, torch.Tensor] | None = None,
             checksum: bool = True, encoded: tuple[list[dict[str, Any]], list[Any]] | None = None,
             part: int | None = None) -> list[list[Any]]:
    """The ZeroMQ messages of one logical message: `[protocol.encode(...)]` when it fits under `cap`, else its parts.
    `part`: cut it finer, into parts of about the header plus `part` bytes each (a sender that copies each part
    as it goes holds no more than that per part)."""
    whole = protocol.encode(mtype, run, fields, tensors, checksum, encoded)
    if part is not None:
        cap = min(cap, len(whole[0]) + part)
    if protocol.message_bytes(whole) <= cap:
        return [whole]
    return split(whole, cap)


def _part_header(run: str, xfer: int, index: int, count: int, frames: list[list[int]],
                 of: dict[str, Any] | None) -> dict[str, Any]:
    header = {"type": "part", "proto": PROTOCOL_VERSION, "run": run, "xfer": xfer, "index": index,
              "count": count, "frames": frames}
    if of is not None:
        header["of"] = of
    return header


def split(whole: list[Any], cap: int) -> list[list[Any]]:
    """Cut a message built by `protocol.encode` into parts of at most `cap` bytes each."""
    frames = [memoryview(f) for f in whole[1:]]
    return [[header, *(frames[ti][off:off + n] for ti, off, n in entries)]
            for header, entries in plan(msgpack.unpackb(whole[0]), cap)]


def plan(of: dict[str, Any], cap: int) -> list[tuple[bytes, list[list[int]]]]:
    """The parts of the logical message whose header is `of` (as `protocol.encode` packs it, tensor entries
    included): each part's header frame and its [tensor, offset, nbytes] ranges, one frame per range."""
    metas = of.get("tensors", [])
    run, xfer = of["run"], random.getrandbits(62)
    base = len(msgpack.packb(_part_header(run, xfer, _BIG, _BIG, [], None))) + 5  # + a list header of up to 5
    base0 = base + len(msgpack.packb({"of": of}))
    chunk = min(CHUNK, cap - base0 - _ENTRY) // ALIGN * ALIGN
    if chunk < ALIGN:
        size = len(msgpack.packb(of))
        raise TooBig(f"a {of['type']!r} message of {size + sum(m['nbytes'] for m in metas)} bytes exceeds "
                     f"cluster.max_message_bytes={cap}, and its header alone ({size} bytes) leaves no room "
                     "to send it in parts; raise cluster.max_message_bytes (on every service)")
    runs: list[list[list[int]]] = [[]]
    used = base0
    for ti, meta in enumerate(metas):
        for off in range(0, meta["nbytes"], chunk):
            n = min(chunk, meta["nbytes"] - off)
            if runs[-1] and used + _ENTRY + n > cap:
                runs.append([])
                used = base
            runs[-1].append([ti, off, n])
            used += _ENTRY + n
    out = []
    for index, entries in enumerate(runs):
        header = msgpack.packb(_part_header(run, xfer, index, len(runs), entries, of if index == 0 else None))
        assert len(header) + sum(n for _, _, n in entries) <= cap, "part header bound is wrong"
        out.append((header, entries))
    return out


def send(sock: zmq.Socket[bytes], msgs: list[list[Any]], identity: bytes | None = None,
         trackers: list[zmq.MessageTracker] | None = None) -> int:
    """Send the messages of `messages` in order; returns the bytes sent."""
    return sum(protocol.send(sock, parts, identity, trackers) for parts in msgs)


def stream(sock: zmq.Socket[bytes], mtype: str, run: str, fields: dict[str, Any], metas: list[dict[str, Any]],
           read: Callable[[int, int, memoryview], None], cap: int, identity: bytes | None = None,
           timeout: float = 120.0) -> int:
    """Send one logical message whose tensor bytes are not in memory: `metas` as `protocol.encode_tensors` makes
    them (checksums included), `read(tensor, offset, buf)` fills `buf` with that tensor's bytes from `offset`. The
    messages are exactly those `messages` would send; at most two of them are held: the bytes of message i+2 are
    read only once ZeroMQ is done with message i's (tracked sends), waited for at most `timeout` s each (then
    `TimeoutError`: the peer does not read), and into message i's buffer. (A new buffer for each message let a third
    be resident: pyzmq drops its reference to a sent buffer on a thread of its own, after the tracker is done; on a
    loaded machine the checkpointer's restore then peaked a part above its bound, tests/test_checkpointer_memory.py.)
    Returns the bytes sent."""
    header = protocol.encode(mtype, run, fields, encoded=(metas, []))[0]
    sizes = [m["nbytes"] for m in metas]
    if len(header) + sum(sizes) <= cap:
        layout = [(header, [[ti, 0, n] for ti, n in enumerate(sizes)])]
    else:
        layout = plan(msgpack.unpackb(header), cap)
    in_flight: list[list[zmq.MessageTracker]] = []
    largest = max(sum(n for _, _, n in entries) for _, entries in layout)
    buffers = [memoryview(bytearray(largest)) for _ in range(min(2, len(layout)))]
    total = 0
    for i, (head, entries) in enumerate(layout):
        if len(in_flight) == 2:
            _sent(in_flight.pop(0), timeout)
        buf = buffers[i % 2]
        frames, at = [], 0
        for ti, off, n in entries:
            frames.append(buf[at:at + n])
            read(ti, off, frames[-1])
            at += n
        trackers: list[zmq.MessageTracker] = []
        total += protocol.send(sock, [head, *frames], identity, trackers)
        in_flight.append(trackers)
        del buf, frames  # ZeroMQ holds them until it has sent them; the buffer is written again only after that
    for trackers in in_flight:
        _sent(trackers, timeout)
    return total


def _sent(trackers: list[zmq.MessageTracker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for t in trackers:
        try:
            t.wait(max(0.0, deadline - time.monotonic()))
        except zmq.NotDone:
            raise TimeoutError(f"a message was not sent within {timeout:g}s: its peer does not read") from None
