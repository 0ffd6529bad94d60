"""Hostile slot descriptors against a default `cmemi up` (shared/memory/shm.py, services/aggregator/common/intake.py).

An admitted worker on the servers' host (it holds the worker key and the Redis credentials, as a worker host does)
is granted shared-memory slots over ipc:// and answers every lease with a gradient whose descriptor is wrong in
one way: not a map, a path out of /dev/shm, another run's segment, a segment that does not exist, a file of the
run's pattern with mode 0644, a tensor past its slot's end, more bytes than a message may carry, an odd sequence,
a slot it is rewriting. A second one, admitted over CurveZMQ tcp:// (never granted slots), sends a well-formed
descriptor. Each is dropped and counted by its reason, nothing crashes, and the run ends bitwise as a fault-free one.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.auth
from cmemi.shared.config.loading import load_config
from cmemi.shared.coordination.membership import Member
from cmemi.shared.core.environment import environment
from cmemi.shared.memory import shm
from cmemi.shared.wire import protocol, samehost

from tests.conftest import DIGITS, LONG
from tests.helpers.chaos import Cluster, poll
from tests.test_security import model_facts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600),
              pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")]


class Rogue(threading.Thread):
    """An admitted worker that answers each lease with one bad descriptor from `bad` (in turn), then asks again."""

    def __init__(self, c: Cluster, wid: str, over_ipc: bool, bad: list[Any]) -> None:
        super().__init__(daemon=True)
        self.c, self.bad = c, bad
        self.member = Member(c.redis, c.keys, "worker", wid, 0.1, 1.0).start()
        self.me = {"wid": wid, "inc": self.member.incarnation}
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys = c.run_dir / "keys"
        public, secret = zmq.auth.load_certificate(str(keys / "worker.key_secret"))
        ends = samehost.parse(c.redis.hget(c.keys.aggregator, "addr"))
        if over_ipc:  # as Curve.connect_local: the worker's secret key proves the role
            self.sock.plain_username, self.sock.plain_password = b"worker", secret
            self.sock.connect(ends.ipc)
        else:
            self.sock.curve_publickey, self.sock.curve_secretkey = public, secret
            self.sock.curve_serverkey = zmq.auth.load_certificate(str(keys / "server.key"))[0]
            self.sock.connect(ends.tcp)
        self.granted: bool | None = None
        self.sent = 0
        self.params_in_slot = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _send(self, mtype: str, tensors: dict[str, torch.Tensor] | None = None, **fields: Any) -> None:
        protocol.send(self.sock, protocol.encode(mtype, self.c.run, {**self.me, **fields}, tensors))

    def _run(self) -> None:
        fp, _ = model_facts()
        env = environment(torch.device("cpu"), load_config(DIGITS))
        self._send("hello", fp=fp, host="evil", env=env, shm=True)
        term = None
        while not self.stop.is_set():
            if not self.sock.poll(100):
                continue
            msg = protocol.decode(self.sock.recv_multipart(copy=False), self.c.run)
            if msg.type == "welcome":
                term, self.granted = msg.header["term"], msg.header.get("shm") is True
            elif msg.type == "work":
                h = msg.header
                self.params_in_slot += "shm" in h
                if self.sent < 2 * len(self.bad):
                    self._send("grad", {}, shm=self.bad[self.sent % len(self.bad)], term=term, step=h["step"],
                               lo=h["lo"], hi=h["hi"], version=h["version"], losses=[0.0], n=16, finite=True,
                               codec={"name": "none"}, encode_s=0.0, lease=h.get("lease", b""))
                    self.sent += 1
                else:
                    self._send("leave")
                    return
            elif msg.type == "stop":
                return
            else:
                raise AssertionError(f"{self.me['wid']} was not admitted: {msg.header}")
            self._send("want", term=term, version=-1)

    def finish(self) -> None:
        self.stop.set()
        self.join(timeout=10)
        self.member.stop()
        self.sock.close(linger=0)
        self.ctx.term()


def test_bad_descriptors_are_dropped_and_counted_same_bits(tmp_path: Path, reference: str) -> None:
    c = Cluster(tmp_path / "run", *LONG, "cluster.workers=2", "cluster.spare_workers=0")
    own = shm.Writer(c.run, "mallory", False)  # the rogue's segments, made as any process of the run could
    rogues: list[Rogue] = []
    try:
        poll(lambda: c.redis.hget(c.keys.aggregator, "addr"), 120, "the aggregator's address")
        good = own.write({"g": torch.zeros(8)})
        slot, _ = own.begin(good["tensors"])  # a slot it is rewriting (odd sequence), named as whole
        torn = {**good, "slot": slot, "seq": 2}
        loose = shm.ROOT / good["seg"].replace("-mallory-", "-loose-")
        loose.write_bytes(bytes(4096))
        loose.chmod(0o644)
        entry = good["tensors"][0]
        huge = {**entry, "shape": [1 << 28], "nbytes": 4 << 28}
        bad = [
            "not a map",  # shm_bad
            {**good, "seg": "../../etc/passwd"},  # shm_bad
            {**good, "seg": good["seg"].replace(shm.run_tag(c.run), "0" * 12)},  # shm_bad: another run's name
            {**good, "seg": good["seg"][:-1] + "9"},  # shm_missing
            {**good, "seg": loose.name},  # shm_not_ours
            {**good, "at": [1 << 20]},  # shm_bounds
            {**good, "tensors": [huge]},  # too_big
            {**good, "seq": 3},  # shm_bad
            torn,  # shm_overwritten
        ]
        mallory = Rogue(c, "mallory", True, bad)
        eve = Rogue(c, "eve", False, [good])  # well-formed, but eve came over tcp://: never granted
        rogues = [mallory, eve]
        for r in rogues:
            r.start()
        poll(lambda: all(not r.is_alive() for r in rogues), 300, "the rogues' descriptors sent")
    finally:
        for r in rogues:
            r.finish()
        rc = c.wait(timeout=600)
        own.close()
        for path in shm.owned(c.run):
            path.unlink()
    assert rc == 0, c.output()
    assert all(r.error is None for r in rogues), [r.error for r in rogues]
    assert mallory.granted is True and eve.granted is False
    assert mallory.sent == 2 * len(bad) and eve.sent == 2
    assert mallory.params_in_slot > 0 and eve.params_in_slot == 0  # slots to the ipc:// one only
    drops = c.summary["dropped_messages"]
    want = {"shm_bad": 2 * 4, "shm_missing": 2, "shm_not_ours": 2, "shm_bounds": 2, "too_big": 2,
            "shm_overwritten": 2, "shm_unexpected": 2}
    assert {k: drops.get(k, 0) for k in want} == want, drops
    assert c.summary["params_sha256"] == reference
    assert not any(p.name.startswith(f"cmemi-{shm.run_tag(c.run)}-") for p in shm.ROOT.iterdir()), os.listdir(shm.ROOT)
