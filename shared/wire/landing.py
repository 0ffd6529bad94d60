"""Where the frames of a part come from and where its bytes land, for the receiver of parts (assembly.py).

A source is a message received whole (`FrameList`) or one still on the socket (`SocketFrames`, each frame read
straight into its range: one frame in memory at a time). A destination is one tensor per entry (`Tensors`: the
caller's `into` when dtype and shape match, else allocated) or a `Sink` (`Sunk`: the checkpointer's spool files,
nothing in memory). `Partial` is one transfer under way: its cursor, its running checksums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import zmq
from cmemi.shared.wire import protocol
from cmemi.shared.wire.protocol import ProtocolError


class FrameList:
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


class SocketFrames:
    """The tensor frames of a message still on the socket: each lands straight in its range (or, for a sink, is
    handed over and released after it): one frame in memory at a time. `budget`: the most bytes its frames may
    have (the caller's message size cap, less the header)."""

    def __init__(self, sock: zmq.Socket[bytes], budget: int | None = None) -> None:
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


class Tensors:
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


class Sunk:
    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def land(self, ti: int, off: int, n: int, source: Any) -> memoryview:
        buf: memoryview = source.take(n)
        self.sink.write(ti, off, buf)
        return buf

    def result(self) -> dict[str, Any]:
        return self.sink.result()

    def discard(self) -> None:
        self.sink.discard()


@dataclass
class Partial:
    xfer: int
    count: int
    header: dict[str, Any]
    names: list[str]
    sizes: list[int]
    dest: Tensors | Sunk
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


def resolve_into(into: Into, header: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The tensors to land a message in: `into` itself, or what it returns for the logical header."""
    return into(header) if callable(into) else into
