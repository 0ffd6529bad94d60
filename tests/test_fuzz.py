"""Fuzzing a running aggregator: >= 10,000 hostile messages must change nothing.

A seeded corpus (reproducible: FUZZ_SEED) of malformed, truncated, oversized and wrong-typed
messages: random bytes, msgpack that is not a map, unknown types, wrong protocol versions, wrong run
ids, missing and wrong-typed fields, broken tensor tables (bad dtypes, huge declared shapes, wrong
lengths and checksums, duplicate names), frame counts that do not match (up to thousands of frames),
well-formed messages of the right run from workers that never said hello, and aggregator-to-worker
message types sent the wrong way. They go from many DEALER identities at full speed, without waiting
for replies, while a real `cmemi up` trains.

The aggregator must stay up (same process, same incarnation, the step counter advancing during and
after the fuzzing), count every message it drops under the reason the protocol gives for it, accept
none (the final parameters are bitwise those of a fault-free run), and a message larger than
`cluster.max_message_bytes` must be cut off by ZeroMQ itself (the peer is disconnected) without the
aggregator ever seeing it.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
import zmq
from cmemi.shared.wire import protocol, samehost, schema
from zmq.utils.monitor import recv_monitor_message

from cmemi.commands.events import load_events
from tests.conftest import LONG
from tests.helpers.chaos import Cluster

FUZZ_SEED = int(os.environ.get("CMEMI_FUZZ_SEED", "20240611"))
N_MESSAGES = 12_000
MAX_MESSAGE_BYTES = 1 << 20
RUN = "fuzzrun"

# What the aggregator sends (or only the checkpointer expects): arriving at the aggregator they are dropped.
WRONG_WAY = ("welcome", "work", "stop", "reject", "snapshot", "saved", "restore_req", "restore", "no_checkpoint")
REAL_WORKERS = ("w0", "w1")
SHAPES = {"0.weight": [128, 64], "0.bias": [128], "3.weight": [128, 128], "3.bias": [128], "5.weight": [10, 128],
          "5.bias": [10]}


# ---------------------------------------------------------------------------------------------- corpus
class Corpus:
    """Seeded generator of hostile messages; each is a list of frames (bytes) without the identity."""

    def __init__(self, run: str, seed: int) -> None:
        self.run = run
        self.rng = random.Random(seed)

    # -- building blocks
    def wid(self) -> str:
        r = self.rng.random()
        if r < 0.1:
            return self.rng.choice(REAL_WORKERS)  # a real worker's id, from a stranger's identity
        if r < 0.2:
            return "".join(chr(self.rng.randrange(32, 0x2FF)) for _ in range(self.rng.randrange(0, 40)))
        return f"fuzz-{self.rng.randrange(10**6)}"

    def inc(self) -> int:
        return self.rng.choice([0, -1, -(2**63), 1, 2**40 + self.rng.randrange(10**6), 2**63 - 1, 2**64 - 1,
                                self.rng.randrange(-(10**9), 10**12)])

    def value(self, kinds: tuple[type, ...]) -> Any:
        """A value of one of the given python types (as the schemas name them)."""
        tp = self.rng.choice(kinds)
        r = self.rng
        if tp is bool:
            return r.random() < 0.5
        if tp is int:
            return r.choice([0, -1, 1, 2**31, -(2**63), 2**64 - 1, r.randrange(-1000, 10**6)])
        if tp is float:
            return r.choice([0.0, -0.0, 1.5, math.nan, math.inf, -math.inf, 1e308, r.random()])
        if tp is str:
            return r.choice(["", "x", "w0", "\x00", "é" * 10, "a" * r.randrange(1, 3000)])
        if tp is dict:
            return r.choice([{}, {"length": 1437, "sha256": "00" * 32}, {"a": [1, 2, {"b": None}]}])
        if tp is list:
            return r.choice([[], [1, 2, 3], [{"name": "x"}]])
        if tp is type(None):
            return None
        if tp is bytes:
            return r.randbytes(r.randrange(0, 64))
        raise AssertionError(tp)

    def wrong_value(self, kinds: tuple[type, ...]) -> Any:
        pool = [None, True, False, 1, -(2**63), 2**64 - 1, 1.5, math.nan, "x", b"\x00\xff", [], [1], {}, {"k": 1}]
        bad = [v for v in pool if not (isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds))]
        return self.rng.choice(bad)

    def fields(self, mtype: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, kinds in schema.required(mtype).items():
            if key == "wid":
                out[key] = self.wid()
            elif key == "inc":
                out[key] = self.inc()
                if out.get("wid") in REAL_WORKERS and 0 < out[key] < 2**40:
                    out[key] = 2**40  # unambiguous: above the real incarnation (about the unix time), not fenced
            elif key == "tensors":
                continue  # filled in with the frames
            else:
                out[key] = self.value(kinds)
        return out

    def tensor(self, name: str | None = None, shape: list[int] | None = None,
               dtype: str = "float32") -> tuple[dict[str, Any], bytes]:
        name = name or self.rng.choice([*SHAPES, "x", ""])
        shape = shape if shape is not None else SHAPES.get(name, [self.rng.randrange(0, 9)])
        n = math.prod(shape) * protocol.DTYPES[dtype].itemsize
        data = self.rng.randbytes(n)
        return {"name": name, "dtype": dtype, "shape": shape, "nbytes": n,
                "xxh": xxhash.xxh3_64_intdigest(data) if self.rng.random() < 0.8 else None}, data

    def valid(self, mtype: str) -> tuple[dict[str, Any], list[bytes]]:
        header = {"type": mtype, "proto": protocol.PROTOCOL_VERSION, "run": self.run, **self.fields(mtype)}
        frames: list[bytes] = []
        if "tensors" in schema.required(mtype):
            metas = []
            for name in self.rng.sample(sorted(SHAPES), self.rng.randrange(0, 3)):
                meta, data = self.tensor(name)
                metas.append(meta)
                frames.append(data)
            header["tensors"] = metas
        return header, frames

    @staticmethod
    def pack(obj: Any) -> bytes:
        return msgpack.packb(obj, use_bin_type=True)

    # -- the categories: each returns the frames of one message
    def garbage(self) -> list[bytes]:
        r = self.rng
        sizes = [0, 1, 2, 7, 64, 300, 1000]
        return [r.randbytes(r.choice(sizes) if r.random() < 0.97 else r.randrange(2000, 70000))
                for _ in range(r.choice([1, 1, 1, 2, 5]))]

    def not_a_map(self) -> list[bytes]:
        r = self.rng
        value = r.choice([None, 1, -1, 1.5, "hello", b"bytes", [1, 2], [self.run, "grad"], True,
                          msgpack.ExtType(5, b"xx"), list(range(r.randrange(0, 2000)))])
        return [self.pack(value)]

    def bad_type(self) -> list[bytes]:
        header, frames = self.valid(self.rng.choice(list(schema.SCHEMAS)))
        choice = self.rng.random()
        if choice < 0.3:
            del header["type"]
        elif choice < 0.6:
            header["type"] = self.rng.choice(["", "GRAD", "grad ", "hello\x00", "fence2", "x" * 500, "__init__"])
        else:
            header["type"] = self.wrong_value((str,))
        return [self.pack(header), *frames]

    def wrong_protocol(self) -> list[bytes]:
        header, frames = self.valid(self.rng.choice(["want", "grad", "hello", "leave", "fence"]))
        if self.rng.random() < 0.2:
            del header["proto"]
        else:
            header["proto"] = self.rng.choice([0, 2, -1, 2**64 - 1, "1", b"\x01", None, [1], 1.5])
        return [self.pack(header), *frames]

    def wrong_run(self) -> list[bytes]:
        header, frames = self.valid(self.rng.choice(["want", "grad", "hello", "leave", "fence"]))
        if self.rng.random() < 0.2:
            del header["run"]
        else:
            header["run"] = self.rng.choice(["", "digits", self.run + "x", self.run.upper(), self.run.encode(),
                                             None, 0, [self.run], "r" * 5000])
        return [self.pack(header), *frames]

    def missing_field(self) -> list[bytes]:
        mtype = self.rng.choice(list(schema.SCHEMAS))
        header, frames = self.valid(mtype)
        required = [k for k in schema.required(mtype) if k in header]
        for key in self.rng.sample(required, self.rng.randrange(1, len(required) + 1)):
            del header[key]
        return [self.pack(header), *frames]

    def wrong_field_type(self) -> list[bytes]:
        mtype = self.rng.choice(list(schema.SCHEMAS))
        header, frames = self.valid(mtype)
        keys = [k for k in schema.required(mtype) if k != "tensors"]
        key = self.rng.choice(keys)
        header[key] = self.wrong_value(schema.required(mtype)[key])
        return [self.pack(header), *frames]

    def wrong_optional_type(self) -> list[bytes]:
        """An optional field (shared/wire/messages/) of the wrong type: dropped as bad_field, as a required one is."""
        mtype = self.rng.choice([t for t, fields in schema.SCHEMAS.items()
                                 if any(not f.required and not f.anything for f in fields.values())])
        header, frames = self.valid(mtype)
        key = self.rng.choice([k for k, f in schema.SCHEMAS[mtype].items() if not f.required and not f.anything])
        header[key] = self.wrong_value(schema.SCHEMAS[mtype][key].types)
        return [self.pack(header), *frames]

    def tensors_not_a_list(self) -> list[bytes]:
        header, frames = self.valid(self.rng.choice(["want", "leave", "hello", "fence", "grad", "work"]))
        header["tensors"] = self.rng.choice([None, 0, 3, -1, 1.5, True, "ab", b"ab", {"0.bias": {}}])
        return [self.pack(header), *frames[: self.rng.randrange(0, 3)]]

    def bad_tensor_table(self) -> list[bytes]:
        r = self.rng
        header, frames = self.valid("grad")
        meta, data = self.tensor()
        kind = r.randrange(12)
        if kind == 0:
            meta = r.choice([None, 1, "x", [meta], b"m"])
        elif kind == 1:
            del meta[r.choice(list(meta))]
        elif kind == 2:
            key = r.choice(list(schema.TENSOR))
            meta[key] = self.wrong_value(schema.TENSOR[key].types)
        elif kind == 3:
            meta["dtype"] = r.choice(["object", "float128", "complex64", "", "torch.float32", "str"])
        elif kind == 4:  # huge declared shapes: the frame is tiny
            meta["shape"] = r.choice([[2**39, 2**39], [2**39] * 8, [10**9, 10**9, 10**9], [2**40 - 1, 2]])
            meta["nbytes"] = r.choice([len(data), 2**63 - 1, math.prod(meta["shape"]) * 4 % 2**63])
        elif kind == 5:
            meta["shape"] = r.choice([[1] * 9, [-4], [2**40], [1.5], [True], ["3"], [None], [[2]], "12"])
        elif kind == 6:  # lengths disagree
            meta["nbytes"] += r.choice([-1, 1, 4, 2**32])
        elif kind == 7:
            data = data[: r.randrange(0, len(data))] if data else b"\x00"
        elif kind == 8:
            data += r.randbytes(r.randrange(1, 9))
        elif kind == 9:  # checksum does not match
            meta["xxh"] = (xxhash.xxh3_64_intdigest(data) + r.randrange(1, 2**32)) % 2**64
        elif kind == 10:  # duplicate names
            header["tensors"] = [meta, dict(meta)]
            return [self.pack(header), data, data]
        else:  # bit flip in the data, checksum kept
            if data:
                i = r.randrange(len(data))
                data = data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]
                meta["xxh"] = meta["xxh"] if meta["xxh"] is not None else 0
        header["tensors"] = [meta]
        return [self.pack(header), data]

    def frame_count(self) -> list[bytes]:
        r = self.rng
        header, frames = self.valid("grad")
        kind = r.randrange(4)
        if kind == 0 and frames:
            return [self.pack(header), *frames[:-1]]
        if kind == 1:
            return [self.pack(header), *frames, r.randbytes(r.randrange(0, 100))]
        if kind == 2:  # giant frame count
            return [self.pack(header), *([b""] * r.choice([500, 2000, 5000]))]
        header["tensors"] = [self.tensor("x", [1])[0]] * r.choice([100, 3000])  # a huge declared table
        return [self.pack(header), b"\x00" * 4]

    def unknown_worker(self) -> list[bytes]:
        """Well-formed messages of the right run from identities that never said hello."""
        mtype = self.rng.choice(["want", "want", "grad", "grad", "hello", "leave"])
        header, frames = self.valid(mtype)
        if mtype == "hello":
            header["fp"] = self.rng.choice([{}, {"length": 1437, "sha256": "ab" * 32}, {"length": "x"}])
        return [self.pack(header), *frames]

    def wrong_way(self) -> list[bytes]:
        header, frames = self.valid(self.rng.choice(WRONG_WAY))
        return [self.pack(header), *frames]

    def truncated(self) -> list[bytes]:
        header, frames = self.valid(self.rng.choice(["want", "grad", "hello", "fence"]))
        raw = self.pack(header)
        if self.rng.random() < 0.7:
            raw = raw[: self.rng.randrange(0, len(raw))]
        else:
            raw += self.rng.randbytes(self.rng.randrange(1, 20))  # trailing bytes after the map
        return [raw, *frames]

    def mutated(self) -> list[bytes]:
        header, frames = self.valid(self.rng.choice(["want", "grad", "hello", "leave"]))
        raw = bytearray(self.pack(header))
        for _ in range(self.rng.randrange(1, 6)):
            raw[self.rng.randrange(len(raw))] = self.rng.randrange(256)
        return [bytes(raw), *frames]

    def hostile_msgpack(self) -> list[bytes]:
        r = self.rng
        kind = r.randrange(5)
        if kind == 0:  # deep nesting
            depth = r.choice([600, 5000, 200_000])
            return [b"\x91" * depth + b"\xc0"]
        if kind == 1:  # declared lengths far beyond the data
            return [r.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                              b"\xc6\xff\xff\xff\xff", b"\xdc\xff\xff"])]
        if kind == 2:  # non-string keys, duplicate keys
            return [r.choice([b"\x81\x01\x02", b"\x81\xc0\x01", b"\x81\x91\x01\x01",
                              b"\x82\xa4type\xa4want\xa4type\xa4grad"])]
        if kind == 3:  # a header map with very many keys (still under the header size limit)
            header, frames = self.valid("want")
            header.update({f"k{i}": i for i in range(r.choice([1000, 20_000]))})
            return [self.pack(header), *frames]
        return [r.choice([b"\xc1", b"\xd4\x00", b"\xd6\xff\x00\x00\x00\x00", b"\xc7\x00\xff"])]  # reserved, ext

    def big(self) -> list[bytes]:
        """Large but under max_message_bytes per frame: a big header, big bogus tensor frames."""
        r = self.rng
        header, _ = self.valid("grad")
        if r.random() < 0.5:
            header["wid"] = "w" * r.randrange(100_000, 900_000)
            return [self.pack(header)]
        n = r.randrange(100_000, 900_000) // 4
        meta, data = self.tensor("0.weight", [n])
        meta["xxh"] = (meta["xxh"] or 0) ^ 1
        header["tensors"] = [meta] * r.choice([1, 3])  # three frames: more than the limit in all, each under it
        return [self.pack(header), *([data] * len(header["tensors"]))]

    CATEGORIES = (("garbage", 10), ("not_a_map", 5), ("bad_type", 8), ("wrong_protocol", 8), ("wrong_run", 8),
                  ("missing_field", 10), ("wrong_field_type", 14), ("tensors_not_a_list", 4),
                  ("bad_tensor_table", 14), ("frame_count", 2), ("unknown_worker", 10), ("wrong_way", 5),
                  ("truncated", 6), ("mutated", 6), ("hostile_msgpack", 2), ("big", 0.15),
                  ("wrong_optional_type", 4))

    def messages(self, n: int) -> list[tuple[str, list[bytes]]]:
        names = [c for c, _ in self.CATEGORIES]
        weights = [w for _, w in self.CATEGORIES]
        out = []
        while len(out) < n:
            cat = self.rng.choices(names, weights)[0]
            frames = getattr(self, cat)()
            if _is_valid_fence(frames, self.run):
                continue  # a well-formed `fence` is the coordinator's to send (see the note in the report)
            out.append((cat, frames))
        return out


def _is_valid_fence(frames: list[bytes], run: str) -> bool:
    try:
        return protocol.decode(frames, run).type == "fence"
    except Exception:
        return False


def expected_drop(frames: list[bytes], run: str) -> str | None:
    """The drop reason the aggregator must count for this message (None: answered, not counted)."""
    try:
        msg = protocol.decode(frames, run, checksum=True)
    except protocol.ProtocolError as exc:
        return exc.reason
    except Exception as exc:  # decode must never raise anything else: a crash of the receiving service
        return f"CRASH {type(exc).__name__}: {exc}"
    if msg.type in ("want", "grad"):
        # never admitted: fenced when the incarnation is <= the fence the aggregator keeps for that id
        # (0 for ids it never saw, the real incarnation - 1 for w0/w1, far below 2**40)
        return "fenced" if msg.header["inc"] <= 0 else "unknown_worker"
    if msg.type in ("hello", "leave"):
        return None  # a hello with the wrong dataset is answered `reject`; a stranger's leave frees nothing
    assert msg.type in WRONG_WAY, msg.type
    return "unexpected_type"


@pytest.fixture(scope="module")
def corpus() -> list[tuple[str, list[bytes], str]]:
    """(category, frames, the drop reason the aggregator must count, or "answered")."""
    return [(cat, frames, expected_drop(frames, RUN) or "answered")
            for cat, frames in Corpus(RUN, FUZZ_SEED).messages(N_MESSAGES)]


def accounted(corpus) -> Counter[str]:
    """Messages by the reason the aggregator must count them under. Multi-frame messages over
    max_message_bytes in all (ZeroMQ limits each frame, not the message) go under "any": dropped, but a
    total-size check in the service may rightly count them under a reason of its own."""
    return Counter("any" if why != "answered" and sum(map(len, frames)) > MAX_MESSAGE_BYTES else why
                   for _cat, frames, why in corpus)


def test_decode_rejects_the_corpus_cleanly(corpus) -> None:
    """In-process first: every hostile message is a ProtocolError (a reason to count), never a crash."""
    crashes = [f"#{i} ({cat}): {why}; header {frames[0][:120]!r}"
               for i, (cat, frames, why) in enumerate(corpus) if why.startswith("CRASH")]
    reasons = Counter(why for _cat, _frames, why in corpus)
    assert not crashes, f"{len(crashes)} messages crash protocol.decode, e.g.:\n" + "\n".join(crashes[:5])
    expected = {"not_msgpack", "not_a_map", "unknown_type", "wrong_protocol", "wrong_run", "missing_field",
                "bad_field", "frame_count", "bad_tensor", "bad_dtype", "bad_shape", "bad_length", "bad_checksum",
                "unknown_worker", "fenced", "unexpected_type", "answered"}
    assert expected <= set(reasons), f"the corpus misses {expected - set(reasons)}: {reasons}"
    optional = Counter(why for cat, _frames, why in corpus if cat == "wrong_optional_type")
    assert set(optional) == {"bad_field"} and optional["bad_field"] > 100, optional  # optional fields are typed too


# ---------------------------------------------------------------------------------------------- sending
class Fuzzer:
    """DEALER sockets with many identities; sends without waiting for the replies.

    ZeroMQ discards what a peer sent but the application has not read yet when that peer disconnects,
    so before a socket is closed a `hello` probe with a unique worker id is sent on it and the test
    waits for its `reject`, which names that id: the aggregator has then processed all the socket sent.
    """

    def __init__(self, addr: str, seed: int, check, n_sockets: int = 12) -> None:
        self.addr = addr
        self.check = check  # raises if the aggregator died
        self.rng = random.Random(seed + 1)
        self.ctx = zmq.Context()
        self.socks = [self._socket(i) for i in range(n_sockets)]
        self.sent = 0
        self.probes = 0

    def _socket(self, i: int) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        if i % 3:  # some with explicit identities (arbitrary bytes, not starting with 0), some anonymous
            s.setsockopt(zmq.IDENTITY, bytes([self.rng.randrange(1, 256)]) + self.rng.randbytes(self.rng.randrange(8, 64)))
        s.setsockopt(zmq.SNDTIMEO, 20_000)  # a stuck aggregator fails the test instead of hanging it
        s.setsockopt(zmq.LINGER, 5_000)
        s.connect(self.addr)
        return s

    def send(self, frames: list[bytes]) -> None:
        i = self.rng.randrange(len(self.socks))
        self.socks[i].send_multipart(frames)
        self.sent += 1
        if self.rng.random() < 0.002:  # churn: a peer goes away, a new one comes
            self._retire(self.socks[i])
            self.socks[i] = self._socket(self.rng.randrange(1000))

    def _retire(self, sock: zmq.Socket, timeout: float = 60) -> None:
        """Wait until the aggregator has processed everything sent on sock, then close it."""
        self.probes += 1
        wid = f"probe-{self.probes}"
        probe = msgpack.packb({"type": "hello", "proto": protocol.PROTOCOL_VERSION, "run": RUN, "wid": wid, "inc": 1,
                               "fp": {}, "host": "fuzzer"})
        deadline = time.monotonic() + timeout
        next_send = 0.0
        while True:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"the aggregator did not answer probe {wid} within {timeout:g}s")
            if now >= next_send:  # again after a while: a reply finding our queue full is dropped by ZeroMQ
                self.check()
                sock.send(probe)
                next_send = now + 1.0
            if sock.poll(100):
                while True:
                    try:
                        reply = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    header = msgpack.unpackb(reply[0])
                    if header.get("type") == "reject" and f"worker {wid} on host" in header.get("reason", ""):
                        sock.close(linger=0)
                        return

    def raw_tcp_garbage(self, n: int) -> None:
        """Not even ZMTP: random bytes, a truncated greeting, a greeting with a bogus mechanism."""
        host, port = self.addr.removeprefix("tcp://").rsplit(":", 1)
        payloads = [self.rng.randbytes(2000), b"\xff" + b"\x00" * 8 + b"\x7f",
                    b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32]
        for i in range(n):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                try:
                    s.sendall(payloads[i % len(payloads)])
                except OSError:
                    pass  # the aggregator may drop the connection at once: fine

    def close(self) -> None:
        """Wait until the aggregator has processed everything, then close."""
        while self.socks:
            self._retire(self.socks.pop())
        self.ctx.term()

    def abort(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.socks = []
        self.ctx.term()


def oversized_is_cut_off_by_zmq(addr: str) -> list[str]:
    """Send messages with a frame over max_message_bytes; ZeroMQ must disconnect us (and reconnect us)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    mon = s.get_monitor_socket()
    seen: list[str] = []

    def wait_for(event: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if mon.poll(50):
                name = zmq.Event(recv_monitor_message(mon)["event"]).name
                seen.append(name)
                if name == zmq.Event(event).name:
                    return
        raise TimeoutError(f"no {zmq.Event(event).name} within {timeout:g}s; monitor saw {seen}")

    try:
        s.connect(addr)
        wait_for(zmq.EVENT_HANDSHAKE_SUCCEEDED, 10)
        too_big = [
            # one frame: a header > 1 MiB; were it decoded it would count as `header_too_big`
            [msgpack.packb({"type": "grad", "proto": 1, "run": RUN, "pad": "x" * (2 * MAX_MESSAGE_BYTES)})],
            # a grad-shaped message whose tensor frame is over the limit
            [msgpack.packb({"type": "grad", "proto": 1, "run": RUN}), b"\x00" * (MAX_MESSAGE_BYTES + 1)],
            # exactly one byte over
            [b"\x00" * (MAX_MESSAGE_BYTES + 1)],
        ]
        for frames in too_big:
            s.send_multipart(frames)
            wait_for(zmq.EVENT_DISCONNECTED, 10)
            wait_for(zmq.EVENT_HANDSHAKE_SUCCEEDED, 10)  # the DEALER reconnects; the aggregator accepts it again
        return seen
    finally:
        s.disable_monitor()
        mon.close(linger=0)
        s.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------------------------------------- the test
class FuzzCluster(Cluster):
    def _info(self) -> dict[str, Any] | None:
        try:
            return super()._info()
        except json.JSONDecodeError:  # `cmemi up` is half-way through writing cluster.json: look again
            return None


@pytest.mark.integration
def test_fuzzed_aggregator_stays_up_and_accepts_nothing(tmp_path: Path, reference: str, corpus, capsys) -> None:
    t0 = time.monotonic()
    c = FuzzCluster(tmp_path / "run", *LONG, "cluster.workers=2", "cluster.spare_workers=0",
                f"cluster.max_message_bytes={MAX_MESSAGE_BYTES}", f"run.name={RUN}",  # its own embedded Redis
                "security.curve=false")  # fuzz the receive path itself: with Curve on, nothing gets that far
    try:
        c.wait_step(40, timeout=180)
        agg = c.redis.hgetall(c.keys.aggregator)
        member = c.redis.hgetall(c.keys.member("aggregator", "0"))
        pid, inc, addr = int(member["pid"]), agg["incarnation"], samehost.tcp_of(agg["addr"])
        assert member["incarnation"] == inc

        def agg_alive() -> None:
            assert _pid_alive(pid), f"the aggregator (pid {pid}) died{crash_report(c)}"
            now = c.redis.hgetall(c.keys.aggregator)
            assert now.get("incarnation") == inc, f"the aggregator was restarted: {now} (was incarnation {inc})"

        t_fuzz = time.monotonic()
        step_before = c.step()
        expected = accounted(corpus)
        fuzzer = Fuzzer(addr, FUZZ_SEED, check=agg_alive)
        samples = [(0.0, step_before)]
        try:
            fuzzer.raw_tcp_garbage(6)
            for i, (_cat, frames, _why) in enumerate(corpus):
                fuzzer.send(frames)
                if i % 1000 == 999:
                    agg_alive()
                    samples.append((time.monotonic() - t_fuzz, c.step()))
            fuzzer.close()  # returns when the aggregator has processed every message
        finally:
            fuzzer.abort()
        agg_alive()
        seen = oversized_is_cut_off_by_zmq(addr)
        fuzz_s = time.monotonic() - t_fuzz
        step_after = c.step()
        samples.append((fuzz_s, step_after))
        print(f"[fuzz] {fuzzer.sent} messages (+{fuzzer.probes} probes) in {fuzz_s:.1f}s; steps {step_before} -> "
              f"{step_after} meanwhile (samples {samples}); oversized: the monitor saw {seen}", flush=True)
        agg_alive()
        assert step_after < 1200, "the run ended before the fuzzing did: make it longer"
        assert step_after > step_before, f"no step while fuzzing: {samples}"
        c.wait_step(step_after + 100, timeout=120)  # and it keeps going afterwards
        agg_alive()
    except BaseException:
        c.close()
        raise
    rc = c.wait()
    assert rc == 0, c.output()
    s = c.summary
    drops = Counter(s["dropped_messages"])
    with capsys.disabled():
        print(f"\n[fuzz] test took {time.monotonic() - t0:.1f}s; {fuzzer.sent} messages in {fuzz_s:.1f}s while "
              f"training went from step {step_before} to {step_after}; dropped_messages {dict(drops)}; "
              f"sent (by expected reason) {dict(expected)}", flush=True)
    steps = [m["step"] for m in c_metrics(c)]
    assert steps == list(range(1, 1201)), "a step was lost or redone"
    assert s["params_sha256"] == reference, "a fuzzed message changed the parameters"
    events = load_events(c.run_dir)
    assert [e for e in events if e["kind"] == "aggregator_started"].__len__() == 1, "the aggregator restarted"
    assert not [e for e in events if e["kind"] in ("died", "fenced", "run_failed")], \
        [e for e in events if e["kind"] in ("died", "fenced", "run_failed")]
    # every hostile message was counted, under the reason the protocol gives for it
    short = {r: (drops.get(r, 0), n) for r, n in expected.items() if r not in ("answered", "any") and drops.get(r, 0) < n}
    assert not short, f"dropped fewer than sent (reason: (dropped, sent)): {short}"
    assert sum(drops.values()) >= sum(n for r, n in expected.items() if r != "answered") >= 10_000
    # oversized frames never reached the aggregator: nothing over 1 MiB got far enough to be `header_too_big`
    assert "header_too_big" not in drops


def crash_report(c: Cluster) -> str:
    """The last traceback in the services' logs (RUN_DIR/logs/) or `cmemi up`'s output, or their tail."""
    text = "".join(p.read_text(errors="replace") for p in sorted((c.run_dir / "logs").glob("*.log")))
    text += Path(c.log.name).read_text(errors="replace")
    at = text.rfind("Traceback")
    return "\n" + (text[at:at + 3000] if at >= 0 else text[-3000:])


def c_metrics(c: Cluster) -> list[dict]:
    return [json.loads(x) for x in (c.run_dir / "metrics.jsonl").read_text().splitlines()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return True


def test_an_admitted_worker_sending_nan_gradients_changes_nothing(tmp_path: Path, reference: str) -> None:
    """A worker with the right dataset (so it is admitted) answers its leases with NaN gradients. The
    aggregator checks each step's sum, not every message: the poisoned sum is caught, the step collected
    again with each gradient checked (the NaN ones dropped and counted), and the run ends bitwise as a
    fault-free one."""
    import torch
    from cmemi.shared.compression.registry import make_codec
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.config.lookup import resolve
    from cmemi.shared.config.plugins import build_model
    from cmemi.shared.config.system import CompressionConfig
    from cmemi.shared.coordination.membership import Member
    from cmemi.shared.core.data import fingerprint
    from cmemi.shared.core.environment import environment
    from zmq import auth as _  # noqa: F401  (zmq.auth.load_certificate)

    from tests.conftest import DIGITS

    cfg = load_config(DIGITS)
    fp = fingerprint(resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs))
    shapes = {n: p.shape for n, p in build_model(cfg).named_parameters()}
    codec = make_codec(CompressionConfig())
    c = Cluster(tmp_path / "run", *LONG, "cluster.workers=1", "cluster.spare_workers=0")
    ctx = zmq.Context()
    member = None
    try:
        c.wait_step(20)
        agg = c.redis.hgetall(c.keys.aggregator)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        keys = c.run_dir / "keys"  # it holds the worker key and registers in Redis, as a worker host can
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(str(keys / "worker.key_secret"))
        sock.curve_serverkey = zmq.auth.load_certificate(str(keys / "server.key"))[0]
        sock.connect(samehost.tcp_of(agg["addr"]))
        member = Member(c.redis, c.keys, "worker", "mallory", 0.1, 1.0).start()
        me = {"wid": "mallory", "inc": member.incarnation}

        def reply(mtype: str) -> protocol.Message:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if sock.poll(100):
                    msg = protocol.decode(sock.recv_multipart(copy=False), c.run)
                    assert msg.type == mtype, msg.header
                    return msg
            raise TimeoutError(f"no {mtype} from the aggregator")

        run = c.run
        env = environment(torch.device("cpu"), cfg)  # a forger that knows the environment, too
        protocol.send(sock, protocol.encode("hello", run, {**me, "fp": fp, "host": "evil", "env": env}))
        term = reply("welcome").header["term"]
        protocol.send(sock, protocol.encode("want", run, {**me, "term": term, "version": -1}))
        for _ in range(5):
            h = reply("work").header
            info, frames = codec.encode({n: torch.full(s, float("nan")) for n, s in shapes.items()}, h["step"])
            protocol.send(sock, protocol.encode("grad", run, {
                **me, "term": term, "step": h["step"], "lo": h["lo"], "hi": h["hi"], "version": h["version"],
                "losses": [0.0] * (h["hi"] - h["lo"]), "n": 16,
                "finite": True, "codec": info, "encode_s": 0.0}, frames))
        protocol.send(sock, protocol.encode("leave", run, me))  # its leases go back at once
    finally:
        if member is not None:
            member.stop()
        rc = c.wait()
        ctx.destroy(linger=0)
    assert rc == 0, c.output()
    s = c.summary
    assert s["dropped_messages"].get("nonfinite_step", 0) >= 1 and s["dropped_messages"].get("codec_nonfinite", 0) >= 1, \
        s["dropped_messages"]
    assert s["params_sha256"] == reference, "a NaN gradient changed the parameters"
