"""A big model's last gradient is out of ZeroMQ's queues before the next one is computed (services/worker/links/inflight.py)."""

from __future__ import annotations

import threading

import torch
import zmq
from cmemi.services.worker.links.inflight import InFlight
from cmemi.shared.wire import protocol


def test_settle_waits_for_the_frames_to_be_read_and_gives_up_on_a_peer_that_does_not_read() -> None:
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        pull.bind("inproc://inflight")
        push.connect("inproc://inflight")
        grad = torch.ones(1 << 18)  # 1 MiB: sent zero-copy, tracked
        sends = InFlight(True, patience_s=0.2)
        protocol.send(push, [b"h", protocol.tensor_bytes(grad)], trackers=sends.trackers)
        tracker = sends.trackers[0]
        sends.settle()  # nobody reads: given up on after the patience, and forgotten
        assert not tracker.done and sends.trackers == []
        reader = threading.Thread(target=lambda: [pull.recv_multipart() for _ in range(2)])
        reader.start()
        protocol.send(push, [b"h", protocol.tensor_bytes(grad)], trackers=sends.trackers)
        second = sends.trackers[0]
        sends.patience_s = 60.0
        sends.settle()  # read: done
        assert second.done
        reader.join(10)
        assert not InFlight(False, 1.0).trackers  # a small model's sends are not tracked
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
