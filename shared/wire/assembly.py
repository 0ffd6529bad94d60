"""The receiver of parts (transfer.py cuts them): reassembles them into logical messages, checking as they come.

The receiver (`Assembler`) keeps at most one partial transfer per peer and at most `peers` in all
(the oldest is abandoned); the logical size is bounded by `bound` (limits.logical_bytes) before
anything is allocated. Tensors land in the caller's `into` tensors when dtype and shape match, else in
one allocation per tensor (`into` may be a function of the message's logical header, to
choose by it), or, with a `sink` (the checkpointer's spool files), nowhere in memory: each
received frame is handed to the sink as it is read, after the same checks (landing.py). A gap, an overlap
or a range past a tensor's end is caught on the spot, and each tensor's checksum is computed as its bytes
arrive (streaming xxh3, equal to the one-shot one). Anything wrong raises `ProtocolError` with a reason
(the caller drops and counts it) and abandons the transfer (a sink's bytes are discarded); its later parts
are dropped as `stale_part`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import xxhash
import zmq
from cmemi.shared.wire import protocol
from cmemi.shared.wire.landing import (
    FrameList,
    Into,
    Partial,
    Sink,
    SocketFrames,
    Sunk,
    Tensors,
    resolve_into,
)
from cmemi.shared.wire.protocol import Message, ProtocolError
from cmemi.shared.wire.transfer import ALIGN


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
        self.partials: OrderedDict[bytes, Partial] = OrderedDict()
        self.dead: OrderedDict[bytes, int] = OrderedDict()  # peer -> its last abandoned transfer id

    def receiving(self) -> list[torch.Tensor]:
        """The tensors of the transfers still arriving (what `into` lent them is not free yet)."""
        return [t for p in self.partials.values() if isinstance(p.dest, Tensors) for t in p.dest.tensors]

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
        return self.feed(peer, header, FrameList(frames[1:]), into)

    def reply(self, sock: zmq.Socket[bytes], log: Any, source: str) -> Message | None:
        """One message waiting on a DEALER (no identity frame): the message, or None while a transfer is incomplete
        or when it is bad (logged with `source` and dropped: a bad reply never ends the reader's loop)."""
        try:
            return self.decode(b"", sock.recv_multipart(copy=False))
        except ProtocolError as exc:
            log.warning(f"bad reply from {source}", error=str(exc))
            return None

    def recv(self, sock: zmq.Socket[bytes], into: Into = None, peer: bytes = b"",
             first: zmq.Frame | None = None, cap: int | None = None) -> Message | None:
        """Like `protocol.recv` (DEALER, PULL), parts included; None while a transfer is incomplete. `first`: the
        header frame, when the caller has read it already (a ROUTER reads the identity and checks the sender
        first); `cap`: the most bytes one ZeroMQ message may have (a bigger one is dropped as `too_big`)."""
        try:
            first = sock.recv(copy=False) if first is None else first
            header, metas = protocol.parse(first, self.run)
            budget = None if cap is None else cap - len(first.bytes)
            if header["type"] == "part":
                return self.feed(peer, header, SocketFrames(sock, budget), into)
            if budget is None:
                return self._whole(protocol.recv_body(sock, header, metas, self.checksum, resolve_into(into, header)), metas)
            rest = []
            while sock.getsockopt(protocol.RCVMORE):
                rest.append(sock.recv(copy=False))
            if (size := protocol.message_bytes([f.buffer for f in rest])) > budget:
                raise ProtocolError("too_big", f"{size + len(first.bytes)} bytes")  # (cap - budget: the header)
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

    def _start(self, peer: bytes, header: dict[str, Any], count: int, into: Into) -> Partial:
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
        if count > total // ALIGN + len(metas) + 1:
            raise ProtocolError("too_many_parts", f"{count} parts for {total} bytes")
        while len(self.partials) >= self.peers:  # bounded memory: the oldest partial transfer goes
            self._abandon(next(iter(self.partials)), "transfer_abandoned", "too many transfers at once")
        into = resolve_into(into, of)
        dest: Tensors | Sunk
        if self.sink is not None and metas:
            dest = Sunk(self.sink(of, metas))
        else:
            tensors = []
            for (dtype, shape, _), name in zip(specs, names, strict=True):
                target = (into or {}).get(name)
                if target is not None and target.dtype == dtype and list(target.shape) == shape \
                        and target.is_contiguous() and target.device.type == "cpu":
                    tensors.append(target)
                else:
                    tensors.append(torch.empty(shape, dtype=dtype))
            dest = Tensors(names, tensors)
        hashes = [xxhash.xxh3_64() if self.checksum and m["xxh"] is not None else None for m in metas]
        p = Partial(header["xfer"], count, of, names, [s[2] for s in specs], dest, hashes, [m["xxh"] for m in metas])
        self.partials[peer] = p
        return p

    def _fill(self, p: Partial, entries: list[Any], source: Any) -> None:
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
