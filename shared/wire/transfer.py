"""Logical messages bigger than `cluster.max_message_bytes` travel as several ZeroMQ messages ("parts").

A message that fits goes out exactly as `protocol.encode` builds it (one ZeroMQ message, no copy). A
bigger one (a gradient, parameters, a snapshot or a restore of a big model) is cut on a chunk grid
(docs/design.md §3): each tensor into chunks of `chunk` bytes (CHUNK = 4 MiB, or less when the cap is
smaller: what fits in one part beside its header), the last one shorter; one frame per chunk; a part
carries a run of whole chunks and is at most the cap, header included. Each part's header is a
`part` message: the transfer id `xfer`, `index` and `count`, and per frame `[tensor, offset, nbytes]`;
part 0 also carries the logical header (`of`, validated like any header, with its tensor entries and
their whole-tensor checksums). Chunks go in order, tensor by tensor, so the receiver checks every
range against one cursor: a gap, an overlap or a range past a tensor's end is caught on the spot, and
each tensor's checksum is computed as its bytes arrive (streaming xxh3, equal to today's one-shot one).

A sender whose logical header alone leaves no room for a chunk under the cap raises `TooBig` (the
services stop with its one line, exit 2); it never sends a message over the cap, since libzmq drops a
peer whose frame exceeds MAXMSGSIZE before the receiver could say why.

The receiver (`Assembler`) keeps at most one partial transfer per peer and at most `peers` in all
(the oldest is abandoned); the logical size is bounded by `bound` (limits.logical_bytes) before
anything is allocated. Tensors land in the caller's `into` tensors when dtype and shape match, else in
one allocation per tensor (`into` may be a function of the message's logical header, to
choose by it), or, with a `sink` (the checkpointer's spool files), nowhere in memory: each
received frame is handed to the sink as it is read, after the same checks. Anything wrong raises
`ProtocolError` with a reason (the caller drops and counts it) and abandons the transfer (a sink's
bytes are discarded); its later parts are dropped as `stale_part`.

A sender whose tensors are not in memory (the checkpointer's restore, read from its files) uses
`stream`: the same messages, each one's bytes read just before it is sent, at most two held.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import torch
import xxhash
import zmq
from cmemi.shared.errors import WireError
from cmemi.shared.wire import protocol
from cmemi.shared.wire.protocol import Message, ProtocolError

CHUNK = 4 << 20  # bytes; a multiple of 64 (docs/design.md §3)
# The part size of the big messages whose receivers bound what they queue (RCVHWM) or whose senders copy each
# part as it goes: gradients, snapshots. Two chunks: a queued part costs 8 MiB, not the cap (docs/design.md §8).
PART = 2 * CHUNK
_ALIGN = 64
_ENTRY = 24  # msgpack bound of one [tensor, offset, nbytes] entry (fixarray + three ints below 2^32 / 2^64)
_BIG = 1 << 32  # stands in for index and count when bounding a part header


class TooBig(WireError):
    """The logical header alone leaves no room for a chunk under the cap."""


# ---------------------------------------------------------------------------------------------- sending
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
    header = {"type": "part", "proto": protocol.PROTOCOL_VERSION, "run": run, "xfer": xfer, "index": index,
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
    chunk = min(CHUNK, cap - base0 - _ENTRY) // _ALIGN * _ALIGN
    if chunk < _ALIGN:
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


def send(sock: zmq.Socket, msgs: list[list[Any]], identity: bytes | None = None,
         trackers: list[zmq.MessageTracker] | None = None) -> int:
    """Send the messages of `messages` in order; returns the bytes sent."""
    return sum(protocol.send(sock, parts, identity, trackers) for parts in msgs)


def stream(sock: zmq.Socket, mtype: str, run: str, fields: dict[str, Any], metas: list[dict[str, Any]],
           read: Callable[[int, int, memoryview], None], cap: int, identity: bytes | None = None,
           timeout: float = 120.0) -> int:
    """Send one logical message whose tensor bytes are not in memory: `metas` as `protocol.encode_tensors` makes
    them (checksums included), `read(tensor, offset, buf)` fills `buf` with that tensor's bytes from `offset`. The
    messages are exactly those `messages` would send; at most two of them are held: the bytes of message i+2 are
    read only once ZeroMQ is done with message i's (tracked sends), waited for at most `timeout` s each (then
    `TimeoutError`: the peer does not read). Returns the bytes sent."""
    header = protocol.encode(mtype, run, fields, encoded=(metas, []))[0]
    sizes = [m["nbytes"] for m in metas]
    if len(header) + sum(sizes) <= cap:
        layout = [(header, [[ti, 0, n] for ti, n in enumerate(sizes)])]
    else:
        layout = plan(msgpack.unpackb(header), cap)
    in_flight: list[list[zmq.MessageTracker]] = []
    total = 0
    for head, entries in layout:
        if len(in_flight) == 2:
            _sent(in_flight.pop(0), timeout)
        buf = memoryview(bytearray(sum(n for _, _, n in entries)))
        frames, at = [], 0
        for ti, off, n in entries:
            frames.append(buf[at:at + n])
            read(ti, off, frames[-1])
            at += n
        trackers: list[zmq.MessageTracker] = []
        total += protocol.send(sock, [head, *frames], identity, trackers)
        in_flight.append(trackers)
        del buf, frames  # ZeroMQ holds them until it has sent them
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


# ---------------------------------------------------------------------------------------------- receiving
class _Frames:
    """The tensor frames of a message received whole (recv_multipart), read one by one."""

    def __init__(self, frames: list[Any]) -> None:
        self.frames, self.i = frames, 0

    def read_into(self, buf: memoryview) -> None:
        if self.i >= len(self.frames):
            raise ProtocolError("frame_count", f"only {len(self.frames)} frames")
        frame = self.frames[self.i]
        self.i += 1
        src = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
        if src.nbytes != buf.nbytes:
            raise ProtocolError("bad_length", f"a frame of {src.nbytes} bytes for a range of {buf.nbytes}")
        buf[:] = src.cast("B")

    def take(self, n: int) -> memoryview:
        """The next frame itself (n bytes), for a sink: no copy."""
        if self.i >= len(self.frames):
            raise ProtocolError("frame_count", f"only {len(self.frames)} frames")
        frame = self.frames[self.i]
        self.i += 1
        src = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
        if src.nbytes != n:
            raise ProtocolError("bad_length", f"a frame of {src.nbytes} bytes for a range of {n}")
        return src.cast("B")

    def finish(self) -> None:
        if self.i != len(self.frames):
            raise ProtocolError("frame_count", f"{len(self.frames)} frames for {self.i} ranges")


class _Socket:
    """The tensor frames of a message still on the socket: each lands straight in its range (or, for a sink, is
    handed over and released after it): one frame in memory at a time. `budget`: the most bytes its frames may
    have (the caller's message size cap, less the header)."""

    def __init__(self, sock: zmq.Socket, budget: int | None = None) -> None:
        self.sock, self.budget = sock, budget

    def _spend(self, n: int) -> None:
        if self.budget is not None:
            self.budget -= n
            if self.budget < 0:
                raise ProtocolError("too_big", "a part over the message size cap")

    def read_into(self, buf: memoryview) -> None:
        if not self.sock.getsockopt(zmq.RCVMORE):
            raise ProtocolError("frame_count", "fewer frames than ranges")
        self._spend(buf.nbytes)
        n = self.sock.recv_into(buf)
        if n != buf.nbytes:
            raise ProtocolError("bad_length", f"a frame of {n} bytes for a range of {buf.nbytes}")

    def take(self, n: int) -> memoryview:
        if not self.sock.getsockopt(zmq.RCVMORE):
            raise ProtocolError("frame_count", "fewer frames than ranges")
        self._spend(n)
        buf = self.sock.recv(copy=False).buffer
        if buf.nbytes != n:
            raise ProtocolError("bad_length", f"a frame of {buf.nbytes} bytes for a range of {n}")
        return buf.cast("B")

    def finish(self) -> None:
        if self.sock.getsockopt(zmq.RCVMORE):
            raise ProtocolError("frame_count", "more frames than ranges")


class Sink(Protocol):
    """Where a transfer's tensor bytes go instead of tensors (the checkpointer spools them to disk): `write` gets
    every range in order, each checked against the header; `result` stands for the tensors of the message once
    all arrived; `discard` undoes it all (a transfer abandoned, or the message dropped afterwards)."""

    def write(self, ti: int, off: int, buf: memoryview) -> None: ...

    def result(self) -> dict[str, Any]: ...

    def discard(self) -> None: ...


class _Tensors:
    """The usual destination: one tensor per entry (the caller's `into`, or allocated)."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        self.names, self.tensors = names, tensors
        self.views = [protocol.tensor_bytes(t) for t in tensors]

    def land(self, ti: int, off: int, n: int, source: Any) -> memoryview:
        buf = self.views[ti][off:off + n]
        source.read_into(buf)
        return buf

    def result(self) -> dict[str, Any]:
        return dict(zip(self.names, self.tensors, strict=True))

    def discard(self) -> None:
        pass


class _Sunk:
    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def land(self, ti: int, off: int, n: int, source: Any) -> memoryview:
        buf = source.take(n)
        self.sink.write(ti, off, buf)
        return buf

    def result(self) -> dict[str, Any]:
        return self.sink.result()

    def discard(self) -> None:
        self.sink.discard()


@dataclass
class _Partial:
    xfer: int
    count: int
    header: dict[str, Any]
    names: list[str]
    sizes: list[int]
    dest: _Tensors | _Sunk
    hashes: list[Any]  # a streaming xxh3 per tensor, or None (checksums off, or none sent)
    expect: list[int | None]
    next: int = 0  # the part index expected next
    ti: int = 0  # the cursor: next byte expected is byte `off` of tensor `ti`
    off: int = 0

    def skip_empty(self) -> None:
        while self.ti < len(self.sizes) and self.off == self.sizes[self.ti]:
            h, want = self.hashes[self.ti], self.expect[self.ti]
            if h is not None and h.intdigest() != want:
                raise ProtocolError("bad_checksum", repr(self.names[self.ti])[:60])
            self.ti, self.off = self.ti + 1, 0


Into = dict[str, torch.Tensor] | Callable[[dict[str, Any]], dict[str, torch.Tensor] | None] | None


def _into(into: Into, header: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    return into(header) if callable(into) else into


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Assembler:
    """Reassembles parts into logical messages; at most one partial transfer per peer, `peers` in all. With `sink`
    (called with a message's validated logical header and tensor entries, it may raise `ProtocolError` to refuse
    it), the bytes of every message with tensors go to its `Sink` instead of tensors, and the message's tensors are
    the sink's `result()`."""

    def __init__(self, run: str, bound: int, checksum: bool = True, peers: int = 1,
                 on_abandon: Callable[[str, str], None] | None = None,
                 sink: Callable[[dict[str, Any], list[dict[str, Any]]], Sink] | None = None) -> None:
        self.run, self.bound, self.checksum, self.peers, self.sink = run, bound, checksum, max(1, peers), sink
        self.on_abandon = on_abandon or (lambda reason, detail: None)
        self.partials: OrderedDict[bytes, _Partial] = OrderedDict()
        self.dead: OrderedDict[bytes, int] = OrderedDict()  # peer -> its last abandoned transfer id

    def receiving(self) -> list[torch.Tensor]:
        """The tensors of the transfers still arriving (what `into` lent them is not free yet)."""
        return [t for p in self.partials.values() if isinstance(p.dest, _Tensors) for t in p.dest.tensors]

    # -- entry points
    def decode(self, peer: bytes, frames: list[Any], into: Into = None,
               allow_parts: bool = True) -> Message | None:
        """A message received whole (identity removed): the message, or None while a transfer is incomplete."""
        if not frames:
            raise ProtocolError("empty", "no frames")
        header, metas = protocol.parse(frames[0], self.run)
        if header["type"] != "part":
            return self._whole(protocol.decode_body(header, metas, frames[1:], self.checksum), metas)
        if not allow_parts:
            raise ProtocolError("unexpected_part", "a part from a peer not admitted")
        return self.feed(peer, header, _Frames(frames[1:]), into)

    def recv(self, sock: zmq.Socket, into: Into = None, peer: bytes = b"",
             first: zmq.Frame | None = None, cap: int | None = None) -> Message | None:
        """Like `protocol.recv` (DEALER, PULL), parts included; None while a transfer is incomplete. `first`: the
        header frame, when the caller has read it already (a ROUTER reads the identity and checks the sender
        first); `cap`: the most bytes one ZeroMQ message may have (a bigger one is dropped as `too_big`)."""
        try:
            first = sock.recv(copy=False) if first is None else first
            header, metas = protocol.parse(first, self.run)
            budget = None if cap is None else cap - len(first.bytes)
            if header["type"] == "part":
                return self.feed(peer, header, _Socket(sock, budget), into)
            if budget is None:
                return self._whole(protocol.recv_body(sock, header, metas, self.checksum, _into(into, header)), metas)
            rest = []
            while sock.getsockopt(zmq.RCVMORE):
                rest.append(sock.recv(copy=False))
            if (size := protocol.message_bytes([f.buffer for f in rest])) > budget:
                raise ProtocolError("too_big", f"{size + cap - budget} bytes")
            return self._whole(protocol.decode_body(header, metas, rest, self.checksum), metas)
        except ProtocolError:
            protocol.drain(sock)
            raise

    def _whole(self, msg: Message, metas: list[Any]) -> Message:
        """A message received whole, through the sink if there is one."""
        if self.sink is None or not metas:
            return msg
        sink = self.sink(msg.header, metas)
        try:
            for ti, t in enumerate(msg.tensors.values()):
                if t.numel():
                    sink.write(ti, 0, protocol.tensor_bytes(t))
        except BaseException:
            sink.discard()
            raise
        return Message(msg.header, sink.result())

    @property
    def pending(self) -> bool:
        return bool(self.partials)

    def keep(self, peers: Any) -> None:
        """Forget the partial transfers of peers not in `peers` (e.g. workers no longer admitted)."""
        for peer in [p for p in self.partials if p not in peers]:
            self._abandon(peer, "transfer_abandoned", "its sender is gone")

    def close(self) -> None:
        """Discard every partial transfer (the service stops), without counting them as abandoned."""
        while self.partials:
            self.partials.popitem()[1].dest.discard()

    def _abandon(self, peer: bytes, reason: str, detail: str) -> None:
        p = self.partials.pop(peer, None)
        if p is None:
            return
        p.dest.discard()
        self._forget(peer, p.xfer)
        self.on_abandon(reason, f"{p.header['type']!r} transfer at part {p.next} of {p.count}: {detail}")

    def _forget(self, peer: bytes, xfer: int) -> None:
        """Remember a dropped transfer, so its later parts are dropped quietly as `stale_part`."""
        self.dead[peer] = xfer
        self.dead.move_to_end(peer)
        while len(self.dead) > 4 * self.peers:
            self.dead.popitem(last=False)

    # -- the parts
    def feed(self, peer: bytes, header: dict[str, Any], source: Any, into: Into = None) -> Message | None:
        xfer, index, count, entries = header["xfer"], header["index"], header["count"], header["frames"]
        if not 0 <= index < count:
            raise ProtocolError("bad_part", f"part {index} of {count}")
        current = self.partials.get(peer)
        if current is None or current.xfer != xfer:
            if index != 0:
                raise ProtocolError("stale_part" if self.dead.get(peer) == xfer else "unknown_transfer",
                                    f"part {index} of transfer {xfer}")
            try:
                p = self._start(peer, header, count, into)
            except ProtocolError:
                self._forget(peer, xfer)
                raise
        else:
            p = current
        try:
            if index != p.next or count != p.count:
                raise ProtocolError("part_order" if index > p.next else "part_repeated",
                                    f"part {index} of {count}, expected {p.next} of {p.count}")
            self._fill(p, entries, source)
            p.next += 1
            if p.next < p.count:
                return None
            p.skip_empty()
            if p.ti != len(p.sizes):
                raise ProtocolError("missing_bytes", f"tensor {p.names[p.ti]!r}"[:80] + f" ends at byte {p.off}")
        except ProtocolError as exc:
            self._abandon(peer, "transfer_abandoned", exc.reason)
            raise
        del self.partials[peer]
        return Message(p.header, p.dest.result())

    def _start(self, peer: bytes, header: dict[str, Any], count: int, into: Into) -> _Partial:
        """Validate part 0's logical header and allocate (or take from `into`) its tensors."""
        if self.partials.get(peer) is not None:  # a new transfer while one from this peer is unfinished
            self._abandon(peer, "transfer_interleaved", "a new transfer started")
        of = header.get("of")
        if not isinstance(of, dict):
            raise ProtocolError("bad_part", "part 0 lacks the logical header")
        of, metas = protocol.check_header(of, self.run)
        if of["type"] == "part":
            raise ProtocolError("bad_part", "a part inside a part")
        specs = [protocol.tensor_spec(m) for m in metas]
        names = [m["name"] for m in metas]
        if len(set(names)) != len(names):
            raise ProtocolError("bad_tensor", "duplicate tensor names")
        total = sum(s[2] for s in specs)
        if total > self.bound:
            raise ProtocolError("too_big", f"a {of['type']!r} of {total} bytes, bound {self.bound}")
        if count > total // _ALIGN + len(metas) + 1:
            raise ProtocolError("too_many_parts", f"{count} parts for {total} bytes")
        while len(self.partials) >= self.peers:  # bounded memory: the oldest partial transfer goes
            self._abandon(next(iter(self.partials)), "transfer_abandoned", "too many transfers at once")
        into = _into(into, of)
        dest: _Tensors | _Sunk
        if self.sink is not None and metas:
            dest = _Sunk(self.sink(of, metas))
        else:
            tensors = []
            for (dtype, shape, _), name in zip(specs, names, strict=True):
                target = (into or {}).get(name)
                if target is not None and target.dtype == dtype and list(target.shape) == shape \
                        and target.is_contiguous() and target.device.type == "cpu":
                    tensors.append(target)
                else:
                    tensors.append(torch.empty(shape, dtype=dtype))
            dest = _Tensors(names, tensors)
        hashes = [xxhash.xxh3_64() if self.checksum and m["xxh"] is not None else None for m in metas]
        p = _Partial(header["xfer"], count, of, names, [s[2] for s in specs], dest, hashes, [m["xxh"] for m in metas])
        self.partials[peer] = p
        return p

    def _fill(self, p: _Partial, entries: list[Any], source: Any) -> None:
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 3 and all(_int(x) for x in entry)):
                raise ProtocolError("bad_range", repr(entry)[:60])
            ti, off, n = entry
            p.skip_empty()
            if ti != p.ti or off != p.off or n <= 0 or ti >= len(p.sizes) or off + n > p.sizes[ti]:
                raise ProtocolError("bad_range", f"[{ti}, {off}, {n}], expected tensor {p.ti} from byte {p.off}")
            buf = p.dest.land(ti, off, n, source)
            if p.hashes[ti] is not None:
                p.hashes[ti].update(buf)
            p.off += n
        source.finish()
