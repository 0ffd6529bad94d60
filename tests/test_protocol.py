"""Wire protocol: round trips without copies, and every kind of malformed message is rejected."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq
from cmemi.shared.wire import protocol
from cmemi.shared.wire.protocol import ProtocolError, decode, encode

RUN = "r1"


def grad_msg(tensors: dict[str, torch.Tensor], **over) -> list:
    fields = {"wid": "w0", "inc": 1, "term": 1, "step": 3, "lo": 0, "hi": 1, "version": 3, "losses": [0.5], "n": 16,
              "finite": True, "codec": {}, "encode_s": 0.0, **over}
    return encode("grad", RUN, fields, tensors)


def as_bytes(parts: list) -> list[bytes]:
    return [bytes(p) for p in parts]


def test_round_trip_all_dtypes() -> None:
    tensors = {n: torch.arange(12).reshape(3, 4).to(dt) for n, dt in protocol.DTYPES.items()}
    tensors["empty"] = torch.zeros(0, 5)
    tensors["scalar"] = torch.tensor(3.5)
    msg = decode(as_bytes(grad_msg(tensors)), RUN)
    assert msg.type == "grad" and msg.header["step"] == 3
    for n, t in tensors.items():
        assert msg.tensors[n].dtype == t.dtype and torch.equal(msg.tensors[n], t)


def test_zero_copy_over_real_sockets() -> None:
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        big = torch.randn(1 << 18)
        sent = protocol.send(a, grad_msg({"w": big}))
        assert sent >= big.numel() * 4
        frames = b.recv_multipart(copy=False)
        msg = decode(frames, RUN)
        assert torch.equal(msg.tensors["w"], big)
        # the tensor is a view of the received frame, not a copy
        assert msg.tensors["w"].data_ptr() == torch.frombuffer(frames[1].buffer, dtype=torch.uint8).data_ptr()
    finally:
        ctx.destroy(linger=0)


def mutate_header(parts: list, **changes) -> list[bytes]:
    header = msgpack.unpackb(parts[0])
    for k, v in changes.items():
        if v is ...:
            header.pop(k)
        else:
            header[k] = v
    return [msgpack.packb(header), *as_bytes(parts[1:])]


MALFORMED = [
    (lambda p: [], "empty"),
    (lambda p: [b"\xc1garbage", *as_bytes(p[1:])], "not_msgpack"),
    (lambda p: [msgpack.packb([1, 2]), *as_bytes(p[1:])], "not_a_map"),
    (lambda p: mutate_header(p, type="rm -rf"), "unknown_type"),
    (lambda p: mutate_header(p, proto=99), "wrong_protocol"),
    (lambda p: mutate_header(p, run="other"), "wrong_run"),
    (lambda p: mutate_header(p, step=...), "missing_field"),
    (lambda p: mutate_header(p, step="3"), "bad_field"),
    (lambda p: mutate_header(p, inc=True), "bad_field"),
    (lambda p: mutate_header(p, ahead=1), "bad_field"),  # an optional field of the wrong type (messages.py)
    (lambda p: mutate_header(p, lease="seal"), "bad_field"),
    (lambda p: as_bytes(p[:-1]), "frame_count"),
    (lambda p: [*as_bytes(p[:-1]), as_bytes(p)[-1][:-4]], "bad_length"),
    (lambda p: [*as_bytes(p[:-1]), b"\x00" * len(as_bytes(p)[-1])], "bad_checksum"),
    (lambda p: mutate_header(p, tensors=[{"name": "w", "dtype": "object", "shape": [4], "nbytes": 16, "xxh": None}]),
     "bad_dtype"),
    (lambda p: mutate_header(p, tensors=[{"name": "w", "dtype": "float32", "shape": [-4], "nbytes": 16, "xxh": None}]),
     "bad_shape"),
    (lambda p: mutate_header(p, tensors=["x"]), "bad_tensor"),
    (lambda p: [b"\x81" + b"\xa1a" * 10 + b"\x00" * (1 << 21)], "header_too_big"),
]


@pytest.mark.parametrize("frames_fn, reason", MALFORMED)
def test_malformed_messages_are_rejected_with_a_reason(frames_fn, reason: str) -> None:
    parts = grad_msg({"w": torch.ones(4)})
    with pytest.raises(ProtocolError) as err:
        decode(frames_fn(parts), RUN)
    assert err.value.reason == reason


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    b.connect(f"tcp://127.0.0.1:{a.bind_to_random_port('tcp://127.0.0.1')}")
    yield a, b
    ctx.destroy(linger=0)


def test_recv_lands_matching_tensors_in_place(pair) -> None:
    a, b = pair
    big, other = torch.randn(300, 300), torch.randn(7)
    into = {"w": torch.zeros(300, 300), "v": torch.zeros(5)}  # "v" has another shape: received as a new frame
    ptr = into["w"].data_ptr()
    protocol.send(a, grad_msg({"w": big, "v": other}))
    msg = protocol.recv(b, RUN, into=into)
    assert msg.tensors["w"] is into["w"] and into["w"].data_ptr() == ptr and torch.equal(into["w"], big)
    assert torch.equal(msg.tensors["v"], other) and torch.equal(into["v"], torch.zeros(5))


@pytest.mark.parametrize("into", [None, {"w": torch.zeros(4)}])
@pytest.mark.parametrize("frames_fn, reason", [c for c in MALFORMED if c[1] != "empty"])
def test_recv_rejects_malformed_messages_and_the_next_one_arrives_whole(pair, into, frames_fn, reason: str) -> None:
    a, b = pair
    a.send_multipart(frames_fn(grad_msg({"w": torch.ones(4)})))
    good = torch.arange(4.0)
    protocol.send(a, grad_msg({"w": good}, step=4))
    with pytest.raises(ProtocolError) as err:
        protocol.recv(b, RUN, into=into)
    assert err.value.reason == reason
    msg = protocol.recv(b, RUN, into=into)
    assert msg.header["step"] == 4 and torch.equal(msg.tensors["w"], good)


def test_random_garbage_never_escapes_as_another_exception() -> None:
    import random

    rng = random.Random(7)
    good = as_bytes(grad_msg({"w": torch.ones(8), "b": torch.zeros(2)}))
    for _ in range(3000):
        frames = [bytearray(f) for f in good]
        i = rng.randrange(len(frames))
        for _ in range(rng.randint(1, 6)):
            if frames[i]:
                frames[i][rng.randrange(len(frames[i]))] = rng.randrange(256)
        if rng.random() < 0.2:
            frames = frames[: rng.randrange(len(frames) + 1)]
        try:
            decode([bytes(f) for f in frames], RUN)
        except ProtocolError:
            pass
