"""CurveZMQ: a stranger (unencrypted, or with a key that is not allowed) cannot submit a gradient or
read parameters — its messages never reach the aggregator's logic — and the run is unaffected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import zmq
from cmemi.shared import protocol
from cmemi.shared.security import generate

from tests.chaos import Cluster, poll
from tests.conftest import LONG

pytestmark = pytest.mark.integration


def public(path: Path) -> str:
    return path.read_text().split('public-key = "')[1].split('"')[0]


def test_strangers_are_locked_out(tmp_path: Path, reference: str) -> None:
    keys = tmp_path / "keys"
    generate(keys, clients=2)  # client0: the cluster; client1: a key nobody allowed
    sets = (*LONG, "security.curve=true", f"security.server_secret_key_file={keys}/server.key_secret",
            f"security.server_public_key={public(keys / 'server.key')}",
            f"security.client_secret_key_file={keys}/client0.key_secret",
            f"security.allowed_client_keys=['{public(keys / 'client0.key')}']", "cluster.workers=2")
    c = Cluster(tmp_path / "run", *sets)
    zctx = zmq.Context()
    try:
        c.wait_step(100)
        addr = c.redis.hget(c.keys.aggregator, "addr")
        run = c.keys.prefix.split(":")[1]
        hello = protocol.encode("hello", run, {"wid": "mallory", "inc": 10**12, "host": "evil",
                                               "fp": {"length": 1, "sha256": "x"}})
        want = protocol.encode("want", run, {"wid": "mallory", "inc": 10**12, "term": 0, "version": -1})
        grad = protocol.encode("grad", run, {"wid": "w0", "inc": 10**12, "term": 1, "step": 0, "m": 0, "version": 0,
                                             "loss": 0.0, "n": 16, "finite": True, "codec": {}, "encode_s": 0.0},
                               {"0.weight": torch.full((128, 64), 1e6)})
        strangers = []
        plain = zctx.socket(zmq.DEALER)  # no encryption at all
        wrong = zctx.socket(zmq.DEALER)  # encrypted, but with a key that is not allowed
        wrong.curve_secretkey, wrong.curve_publickey = zmq.auth.load_certificate(str(keys / "client1.key_secret"))[::-1]
        wrong.curve_serverkey = public(keys / "server.key").encode()
        for sock in (plain, wrong):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            for msg in (hello, want, grad) * 20:
                sock.send_multipart(msg, copy=True)
            strangers.append(sock)
        steps_before = c.step()
        poll(lambda: c.step() > steps_before + 50, 60, "training going on")
        for sock in strangers:
            assert sock.poll(500) == 0, "a stranger got an answer (parameters or anything else)"
    finally:
        zctx.destroy(linger=0)
        rc = c.wait()
    assert rc == 0, c.output()
    s = c.summary
    assert s["params_sha256"] == reference
    assert s["dropped_messages"] == {}, "stranger messages reached the aggregator's logic"
    events = [json.loads(x) for x in (c.run_dir / "events.jsonl").read_text().splitlines()]
    assert not any(e.get("worker") == "mallory" for e in events)
