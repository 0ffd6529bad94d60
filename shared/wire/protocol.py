"""The wire protocol: every message validated on receipt against its type's declaration (shared/wire/messages/).

A message is a ZeroMQ multipart message: frame 0 is a small msgpack header, the next frames are
raw tensor bytes, one per entry of the header's `tensors` list, sent and received without copies
(`torch.frombuffer` over the received frame). Big buffers never go through msgpack.

`decode` raises `ProtocolError` (with a short `reason` used as a drop-counter label) for anything
malformed: services drop such a message, log it and count it, and carry on. A message it returns has every field
its type declares, optional ones filled in with their defaults: a handler reads `h["ahead"]`, never tests a type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import xxhash
import zmq
from cmemi.shared.errors import WireError
from cmemi.shared.wire.header import PROTOCOL_VERSION, header_only
from cmemi.shared.wire.header import header as make_header
from cmemi.shared.wire.messages import ABSENT
from cmemi.shared.wire.schema import SCHEMAS, TENSOR, Field

# dtype name on the wire -> torch dtype. A closed table: nothing else is ever constructed.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_ZERO_COPY_MIN = 1 << 16  # below this, copying is cheaper than zero-copy bookkeeping (pyzmq docs)

# pyzmq's flags and options are enum members: `zmq.SNDMORE | zmq.NOBLOCK` builds a new IntFlag (0.8 us a frame), and
# `getsockopt(zmq.EVENTS)` returns one (6.7 us against 1.8 us with the option as a plain int), `sock.poll` builds a
# Poller and a dict around one zmq_poll (5.7 us against 1.4 us; python -m timeit, 2-core machine). Every message pays
# them, several times a step at the leader (issue 45's small-step floor): the per-message path uses plain ints.
SNDMORE, NOBLOCK, POLLIN, POLLOUT, EVENTS, RCVMORE = (int(f) for f in (zmq.SNDMORE, zmq.NOBLOCK, zmq.POLLIN,
                                                                         zmq.POLLOUT, zmq.EVENTS, zmq.RCVMORE))


class ProtocolError(WireError, ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class Message:
    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def type(self) -> str:
        mtype: str = self.header["type"]  # `parse` checked it is a str; the header dict itself is untyped
        return mtype


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy().data  # ndarray.data: memoryview(array), typed


def encode_tensors(tensors: dict[str, torch.Tensor], checksum: bool = True) -> tuple[list[dict[str, Any]], list[Any]]:
    """The header entries and frames of `tensors`; computed once, they can go out in any number of messages."""
    metas, frames = [], []
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.detach().cpu().contiguous()
        buf = tensor_bytes(t)
        metas.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                      "nbytes": buf.nbytes, "xxh": xxhash.xxh3_64_intdigest(buf) if checksum else None})
        frames.append(buf)
    return metas, frames


def encode(mtype: str, run: str, fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None,
           checksum: bool = True, encoded: tuple[list[dict[str, Any]], list[Any]] | None = None) -> list[Any]:
    """Header + one frame per tensor (or per frame of `encoded`, from `encode_tensors`). Tensors must be
    contiguous CPU tensors that nobody mutates until sent."""
    if encoded is None and tensors is not None:
        encoded = encode_tensors(tensors, checksum)
    if encoded is None:
        return [header_only(mtype, run, fields)]
    header = make_header(mtype, run, fields)
    header["tensors"] = encoded[0]
    return [msgpack.packb(header), *encoded[1]]


def send(sock: zmq.Socket[bytes], parts: list[Any], identity: bytes | None = None,
         trackers: list[zmq.MessageTracker] | None = None, noblock: bool = False) -> int:
    """Send a message built by `encode`; large frames go zero-copy (with `trackers`: tracked, each frame's
    tracker appended, so the caller knows when ZeroMQ no longer reads the buffer). Returns the bytes sent.
    `noblock`: raise zmq.Again instead of waiting when the socket takes nothing now (shared/wire/sendq.py); once
    its first frame is taken, ZeroMQ takes a message's every frame (its high-water mark counts whole messages)."""
    if identity is not None:
        parts = [identity, *parts]
    last = len(parts) - 1
    total = 0
    for i, part in enumerate(parts):
        n = part.nbytes if isinstance(part, memoryview) else len(part)
        total += n
        flags = (SNDMORE if i < last else 0) | (NOBLOCK if noblock else 0)
        if n < _ZERO_COPY_MIN:
            sock.send(part, flags=flags)
        elif trackers is not None:
            trackers.append(sock.send(part, flags=flags, copy=False, track=True))
        else:
            sock.send(part, flags=flags, copy=False)
    return total - (len(identity) if identity is not None else 0)


def _check_fields(header: dict[str, Any], schema: dict[str, Field], what: str) -> None:
    """Every declared field present and of its type, and each absent optional one filled in with its default
    (shared/wire/messages/), in place: a handler reads `h["ahead"]`, never tests a type again."""
    for key, field in schema.items():
        value = header.get(key, ABSENT)
        if value is ABSENT:
            if field.required:
                raise ProtocolError("missing_field", f"{what} lacks field {key!r}")
            if field.default is not ABSENT:
                header[key] = field.fill()
        elif not field.accepts(value):
            expected = " or ".join(t.__name__ for t in field.types)
            raise ProtocolError("bad_field", f"{what} field {key!r} has type {type(value).__name__}, expected {expected}")


def parse(first: Any, run: str) -> tuple[dict[str, Any], list[Any]]:
    """Validate a header frame; returns the header and its tensor entries."""
    raw = first.bytes if isinstance(first, zmq.Frame) else bytes(first)
    if len(raw) > 1 << 20:
        raise ProtocolError("header_too_big", f"{len(raw)} bytes")
    try:
        header = msgpack.unpackb(raw, strict_map_key=True)
    except Exception as exc:  # msgpack raises many unrelated types for hostile input
        raise ProtocolError("not_msgpack", type(exc).__name__) from None
    return check_header(header, run)


def check_header(header: Any, run: str) -> tuple[dict[str, Any], list[Any]]:
    """Validate an unpacked header (a message's, or the logical one a part 0 carries)."""
    if not isinstance(header, dict):
        raise ProtocolError("not_a_map", type(header).__name__)
    mtype = header.get("type")
    if not isinstance(mtype, str) or mtype not in SCHEMAS:
        raise ProtocolError("unknown_type", repr(mtype)[:40])
    if header.get("proto") != PROTOCOL_VERSION:
        raise ProtocolError("wrong_protocol", f"version {header.get('proto')!r}, expected {PROTOCOL_VERSION}")
    if header.get("run") != run:
        raise ProtocolError("wrong_run", f"run id {str(header.get('run'))[:40]!r}")
    _check_fields(header, SCHEMAS[mtype], mtype)
    metas = header.get("tensors", [])
    if not isinstance(metas, list):
        raise ProtocolError("bad_field", f"{mtype} field 'tensors' has type {type(metas).__name__}")
    for meta in metas:
        if not isinstance(meta, dict):
            raise ProtocolError("bad_tensor", "tensor entry is not a map")
        _check_fields(meta, TENSOR, "tensor")
    return header, metas


def decode(frames: list[Any], run: str, checksum: bool = True) -> Message:
    """Validate and decode a received message (frames as received with copy=False, identity removed)."""
    if not frames:
        raise ProtocolError("empty", "no frames")
    return decode_body(*parse(frames[0], run), frames[1:], checksum)


def decode_body(header: dict[str, Any], metas: list[Any], frames: list[Any], checksum: bool = True) -> Message:
    """The message of a validated header (from `parse`) and its tensor frames."""
    if header["type"] == "part":
        raise ProtocolError("unexpected_part", "a part of a bigger message, and no reassembly here")
    if len(frames) != len(metas):
        raise ProtocolError("frame_count", f"{len(frames)} frames for {len(metas)} tensors")
    tensors = {meta["name"]: _tensor(meta, frame, checksum) for meta, frame in zip(metas, frames, strict=True)}
    if len(tensors) != len(metas):
        raise ProtocolError("bad_tensor", "duplicate tensor names")
    return Message(header, tensors)


def recv(sock: zmq.Socket[bytes], run: str, checksum: bool = True, into: dict[str, torch.Tensor] | None = None) -> Message:
    """Receive and decode one message from a socket without identity frames (DEALER, PULL).

    A tensor named in `into` whose dtype and shape match the header is received straight into that
    tensor's memory: no allocation, no copy, and the message holds `into`'s tensor. On ProtocolError
    the whole message has been consumed, and tensors of `into` may hold partial data.
    """
    try:
        return recv_body(sock, *parse(sock.recv(copy=False), run), checksum, into)
    except ProtocolError:
        drain(sock)
        raise


def poll(sock: zmq.Socket[bytes], timeout_ms: int, events: int = POLLIN) -> int:
    """`sock.poll(timeout_ms, events)` without its Poller: the events ready (0: none within `timeout_ms`; -1: wait)."""
    ready = zmq.zmq_poll([(sock, events)], timeout_ms)
    return int(ready[0][1]) if ready else 0


def drain(sock: zmq.Socket[bytes]) -> None:
    """Read the rest of a bad message: it must not be read as the next one."""
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(copy=False)


def recv_body(sock: zmq.Socket[bytes], header: dict[str, Any], metas: list[Any], checksum: bool = True,
              into: dict[str, torch.Tensor] | None = None) -> Message:
    """The tensor frames of a message whose header `parse` validated (see `recv`; the caller drains on error)."""
    if header["type"] == "part":
        raise ProtocolError("unexpected_part", "a part of a bigger message, and no reassembly here")
    tensors: dict[str, torch.Tensor] = {}
    for meta in metas:
        if not sock.getsockopt(zmq.RCVMORE):
            raise ProtocolError("frame_count", f"{len(tensors)} frames for {len(metas)} tensors")
        target = (into or {}).get(meta["name"])
        if target is not None and DTYPES.get(meta["dtype"]) == target.dtype and meta["shape"] == list(target.shape) \
                and target.is_contiguous():
            buf = tensor_bytes(target)
            n = sock.recv_into(buf)
            if n != buf.nbytes or meta["nbytes"] != n:
                raise ProtocolError("bad_length", f"{meta['name']!r}: {n} bytes, shape needs {buf.nbytes}")
            if checksum and meta["xxh"] is not None and xxhash.xxh3_64_intdigest(buf) != meta["xxh"]:
                raise ProtocolError("bad_checksum", repr(meta["name"])[:60])
            tensors[meta["name"]] = target
        else:
            tensors[meta["name"]] = _tensor(meta, sock.recv(copy=False), checksum)
    if sock.getsockopt(zmq.RCVMORE):
        raise ProtocolError("frame_count", f"more frames than the {len(metas)} tensors")
    if len(tensors) != len(metas):
        raise ProtocolError("bad_tensor", "duplicate tensor names")
    return Message(header, tensors)


def tensor_spec(meta: dict[str, Any]) -> tuple[torch.dtype, list[int], int]:
    """dtype, shape and byte length of a tensor entry, validated (nbytes must match the shape)."""
    dtype = DTYPES.get(meta["dtype"])
    if dtype is None:
        raise ProtocolError("bad_dtype", repr(meta["dtype"])[:40])
    shape = meta["shape"]
    if len(shape) > 8 or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
        raise ProtocolError("bad_shape", repr(shape)[:60])
    expected = math.prod(shape) * dtype.itemsize
    if meta["nbytes"] != expected:
        raise ProtocolError("bad_length", f"{meta['name']!r}: header says {meta['nbytes']} bytes, shape needs {expected}")
    return dtype, shape, expected


def _tensor(meta: dict[str, Any], frame: Any, checksum: bool) -> torch.Tensor:
    dtype, shape, expected = tensor_spec(meta)
    buf = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    if buf.nbytes != expected:
        raise ProtocolError("bad_length", f"{meta['name']!r}: {buf.nbytes} bytes, header says {meta['nbytes']}, shape needs {expected}")
    if checksum and meta["xxh"] is not None and xxhash.xxh3_64_intdigest(buf) != meta["xxh"]:
        raise ProtocolError("bad_checksum", repr(meta["name"])[:60])
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if buf.readonly:  # received zmq frames are writable (zero copy); plain bytes (tests, tools) get one copy
        buf = memoryview(bytearray(buf))
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def message_bytes(frames: list[Any]) -> int:
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)


def bind(sock: zmq.Socket[bytes], host: str, port: int) -> str:
    """Bind to host:port (port 0: a free port chosen by the OS) and return the address peers connect to."""
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"
