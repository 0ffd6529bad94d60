"""The aggregator's outgoing parameters: encoded once per version, buffers reused only after ZeroMQ let go."""

from __future__ import annotations

import time

import torch
import zmq
from cmemi.services.aggregator.common.publish import Publisher
from cmemi.shared.wire import protocol

RUN = "r1"


def send_params(sock: zmq.Socket, publisher: Publisher, params: dict[str, torch.Tensor], version: int) -> None:
    encoded, trackers = publisher.encoded(params, version)
    fields = {"term": 1, "step": version, "lo": 0, "hi": 1, "version": version, "scale": 1.0}
    protocol.send(sock, protocol.encode("work", RUN, fields, encoded=encoded), trackers=trackers)


def pair(ctx: zmq.Context, name: str) -> tuple[zmq.Socket, zmq.Socket]:
    """Over inproc, ZeroMQ hands zero-copy frames over by reference: the receiver reads the sender's very bytes
    when it calls recv, so a change made to them after the send (and before that recv) shows. Over TCP libzmq
    may already have copied them into the kernel, and a test could not tell a copy from the live tensor."""
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind(f"inproc://{name}")
    b.connect(f"inproc://{name}")
    return a, b


def in_flight(trackers: list[zmq.MessageTracker]) -> bool:
    """Some send of these frames still holds them (nobody has read and released them yet)."""
    return any(not t.done for t in trackers)


def wait_released(copy) -> None:
    """Poll until ZeroMQ lets go of a copy's frames (it releases one once nobody references it)."""
    deadline = time.monotonic() + 10
    while not copy.idle():
        assert time.monotonic() < deadline, "the received frame was never released"
        time.sleep(0.01)


def test_encoded_once_per_version_and_immune_to_later_optimizer_steps() -> None:
    """Not pipelined and too big for flat buffers: the live tensors go out, copy-on-write. A step (after `protect`,
    the Trainer's hook) while sends of them are queued moves the tensors to new storage; the queued sends keep
    the old bytes."""
    ctx = zmq.Context()
    try:
        a, b = pair(ctx, "publish-immune")
        params = {"w": torch.randn(256, 256), "b": torch.randn(3)}
        pub = Publisher(checksum=True)
        assert pub.live
        first, _ = pub.encoded(params, 0)
        assert pub.encoded(params, 0)[0] is first  # same version: no new encoding, no new checksum
        expected = {n: p.clone() for n, p in params.items()}
        storage = params["w"].data_ptr()
        for _ in range(3):
            send_params(a, pub, params, 0)
        assert in_flight(pub.encoded(params, 0)[1])  # the frames are not read yet: what b reads is what is there now
        pub.protect()
        assert params["w"].data_ptr() != storage  # moved: the queued sends hold the old storage
        with torch.no_grad():
            params["w"].add_(1.0)  # the optimizer steps while the sends are in flight
        for _ in range(3):
            msg = protocol.decode(b.recv_multipart(copy=False), RUN)
            assert all(torch.equal(msg.tensors[n], expected[n]) for n in params)
        second, _ = pub.encoded(params, 1)
        assert second is not first
        send_params(a, pub, params, 1)
        msg = protocol.decode(b.recv_multipart(copy=False), RUN)
        assert torch.equal(msg.tensors["w"], params["w"])
    finally:
        ctx.destroy(linger=0)


def test_buffers_are_reused_only_when_no_send_holds_them() -> None:
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://publish-test")  # inproc passes zero-copy frames by reference: held until b reads
        b.connect("inproc://publish-test")
        params = {"w": torch.randn(512, 512)}
        v0 = params["w"].clone()
        pub = Publisher(checksum=False, keep_previous=True)  # pipelined
        send_params(a, pub, params, 0)
        held = pub._current
        assert held is not None and not held.idle()
        versions = {}
        for v in range(1, 6):
            with torch.no_grad():
                params["w"].add_(1.0)
            versions[v] = params["w"].clone()
            pub.encoded(params, v)
            assert pub._current is not held and torch.equal(pub._current.tensors["w"], params["w"])
        # version 0's copy stayed untouched; versions 1-5 took turns in two others: the version before the current
        # one stays encoded and untouched too (a pipelined shard serves it until the commit)
        assert len(pub._copies) == 3 and torch.equal(held.tensors["w"], v0)
        kept = pub.kept(4)
        assert kept is not None and pub.kept(3) is None and pub.kept(5) is not None
        assert torch.equal(torch.frombuffer(kept[0][1][0], dtype=torch.float32).view(512, 512), versions[4])
        msg = protocol.decode(b.recv_multipart(copy=False), RUN)
        assert torch.equal(msg.tensors["w"], v0)
        del msg
        wait_released(held)
        pub.encoded(params, 6)
        assert len(pub._copies) == 3
    finally:
        ctx.destroy(linger=0)


def test_unpipelined_the_live_tensors_go_out_and_move_only_when_a_send_holds_them() -> None:
    """Not pipelined, nothing serves the version before the current one: no copy of the slice at all; the step
    finds every send done and changes the tensors in place, unless a send still holds them (a slow worker)."""
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://publish-unpipelined")
        b.connect("inproc://publish-unpipelined")
        params = {"w": torch.randn(256, 256)}
        pub = Publisher(checksum=False)
        storage = params["w"].data_ptr()
        send_params(a, pub, params, 0)
        msg = protocol.decode(b.recv_multipart(copy=False), RUN)
        assert msg.tensors["w"].data_ptr() == storage  # inproc: the receiver reads the live tensor itself
        del msg
        deadline = time.monotonic() + 10
        while in_flight(pub.encoded(params, 0)[1]):
            assert time.monotonic() < deadline, "the received frame was never released"
            time.sleep(0.01)
        for v in range(1, 5):
            pub.protect()  # every send done: the step changes the tensors in place
            with torch.no_grad():
                params["w"].add_(1.0)
            pub.encoded(params, v)
            assert pub.kept(v - 1) is None and params["w"].data_ptr() == storage
        assert pub._copies == []
        send_params(a, pub, params, 4)
        pub.protect()  # b has not read it: the tensors move, the send keeps version 4's bytes
        assert params["w"].data_ptr() != storage
        v4 = params["w"].clone()
        with torch.no_grad():
            params["w"].add_(1.0)
        assert torch.equal(protocol.decode(b.recv_multipart(copy=False), RUN).tensors["w"], v4)
    finally:
        ctx.destroy(linger=0)


def test_a_small_model_goes_out_flat_once_per_version() -> None:
    """One frame per dtype in the layout the worker builds from its own model (shared/wire/layout.py)."""
    from cmemi.shared.wire.layout import Layout

    ctx = zmq.Context()
    try:
        a, b = pair(ctx, "publish-flat")
        params = {"w": torch.randn(256, 256), "b": torch.randn(3), "~n": torch.tensor(7)}
        layout = Layout(params)
        pub = Publisher(checksum=True, layout=layout)
        first, _ = pub.encoded(params, 0)
        assert pub.encoded(params, 0)[0] is first and [m["name"] for m in first[0]] == ["flat.float32", "flat.int64"]
        expected = params["w"].clone()
        send_params(a, pub, params, 0)
        assert in_flight(pub.encoded(params, 0)[1])
        with torch.no_grad():
            params["w"].add_(1.0)
        received = layout.views(protocol.decode(b.recv_multipart(copy=False), RUN).tensors)
        assert torch.equal(received["w"], expected) and torch.equal(received["~n"], torch.tensor(7))
        send_params(a, pub, params, 1)
        assert torch.equal(layout.views(protocol.decode(b.recv_multipart(copy=False), RUN).tensors)["w"], params["w"])
    finally:
        ctx.destroy(linger=0)
