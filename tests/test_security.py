"""Hostile clients against a default `cmemi up` (CurveZMQ on, keys made for the run), and with Curve off.

One cluster run per mode proves many things (CI time):
- a stranger (no key) gets nothing through the handshake: forged hellos, 10,000 garbage messages, an
  unterminated multipart message of 4 MiB frames, checkpointer crash / exfiltration / poisoning messages;
- a client holding a valid *worker* key is stopped by the role checks (checkpointer messages, fences) and
  by the incarnation check (forged hellos with huge incarnations for the real worker ids);
- a registered, admitted worker that hoards a lease every step and injects gradients for microbatches it
  was not leased cannot stall the run (withheld leases are handed out again) or change a bit;
- the run exits 0 with the fault-free params_sha256, the aggregator's RSS grows by < 100 MB, no
  forged checkpoint is written, and `ps -eo args` never shows the Redis password.
With `security.curve: false`, the attacks that need no key (forged hellos, crash and poisoning messages,
hoarding) still leave the run at exit 0 with the fault-free params_sha256.
"""

from __future__ import annotations

import re
import socket
import struct
import subprocess
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgpack
import pytest
import torch
import zmq
import zmq.auth
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model
from cmemi.shared.coordination.membership import Member
from cmemi.shared.core.data import fingerprint
from cmemi.shared.wire import protocol, samehost

from cmemi.commands.events import load_events
from tests.conftest import DIGITS, LONG
from tests.helpers.chaos import Cluster

pytestmark = pytest.mark.integration


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Attacker:
    """DEALER sockets to the aggregator and the checkpointer: plain, or with one of the run's key pairs."""

    def __init__(self, c: Cluster, key: str | None) -> None:
        self.c, self.key = c, key
        self.ctx = zmq.Context()
        self.run = c.run
        self.agg_addr = samehost.tcp_of(c.redis.hget(c.keys.aggregator, "addr"))
        self.ckpt_addr = c.redis.hget(c.keys.checkpointer, "addr")
        self.term = int(c.redis.get(c.keys.term))
        self.socks: list[zmq.Socket] = []

    def socket(self, addr: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 0)
        if self.key is not None:
            keys = self.c.run_dir / "keys"
            s.curve_publickey, s.curve_secretkey = zmq.auth.load_certificate(str(keys / f"{self.key}.key_secret"))
            s.curve_serverkey = zmq.auth.load_certificate(str(keys / "server.key"))[0]
        s.connect(addr)
        self.socks.append(s)
        return s

    def send(self, sock: zmq.Socket, frames: list[Any]) -> None:
        try:
            sock.send_multipart(frames)
        except zmq.Again:  # a stranger's messages find no peer: they go nowhere, which is the point
            pass

    def forged_hellos(self) -> zmq.Socket:
        s = self.socket(self.agg_addr)
        for wid in ("w0", "w1"):
            for inc in (2**62, 2**63 - 1):
                self.send(s, protocol.encode("hello", self.run, {"wid": wid, "inc": inc, "host": "evil",
                                                                  "fp": {"length": 1, "sha256": "x"}}))
        return s

    def fence(self) -> None:
        self.send(self.socket(self.agg_addr), protocol.encode("fence", self.run, {"wid": "w0", "inc": 2**62}))

    def checkpointer_attacks(self, term: int) -> zmq.Socket:
        """Crash (bytes in meta), exfiltration (restore_req), poisoning (a snapshot at step 10**9)."""
        s = self.socket(self.ckpt_addr)
        crash = protocol.encode("snapshot", self.run, {"step": 10, "term": term, "final": False,
                                                        "meta": {"model": b"\x00\x01", "progress": {"x": b"y"}}},
                                {"w": torch.zeros(4)})
        poison_meta = {"model": {}, "optimizer": {}, "scheduler": None, "rng": {}, "scaler": {},
                       "progress": {"step": 10**9, "term": term, "final_loss": 0.0, "bytes_sent": 0,
                                    "bytes_received": 0, "fingerprint": {}, "skipped": 0, "wall_s": 0.0}}
        poison = protocol.encode("snapshot", self.run, {"step": 10**9, "term": term, "final": True,
                                                         "meta": poison_meta}, {"w": torch.full((4,), 5.0)})
        for frames in (crash, poison, protocol.encode("restore_req", self.run, {"term": term})) * 11:
            self.send(s, frames)
        return s

    def garbage(self, n: int) -> None:
        s = self.socket(self.agg_addr)
        rnd = torch.Generator().manual_seed(0)
        for i in range(n):
            self.send(s, [torch.randint(0, 256, (int(i % 97) + 1,), generator=rnd, dtype=torch.uint8).numpy().tobytes()])

    def unterminated_multipart(self, frames: int = 300, size: int = 4 << 20) -> int:
        """Raw ZMTP 3.0 (NULL mechanism): a greeting, READY, then `frames` 4 MiB frames that all say "more".
        Returns the bytes the server took before closing the connection."""
        host, port = self.agg_addr.removeprefix("tcp://").rsplit(":", 1)
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
        props = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        ready = b"\x05READY" + props
        sent = 0
        with socket.create_connection((host, int(port)), timeout=10) as s:
            try:
                s.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
                chunk = b"\x03" + struct.pack(">Q", size) + b"\x00" * size  # MORE | LONG
                for _ in range(frames):
                    s.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass  # the server hung up: what we want
        return sent

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()


class Hoarder(threading.Thread):
    """A registered, admitted worker (as a worker host can make one: it holds Redis credentials and the worker
    key) that asks for work again as soon as it gets a lease, and never answers one — except with gradients for
    microbatches it was NOT leased (all 5.0)."""

    def __init__(self, attacker: Attacker, fp: dict[str, Any], shapes: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        c = attacker.c
        self.member = Member(c.redis, c.keys, "worker", "mallory", 0.1, 1.0).start()
        self.me = {"wid": "mallory", "inc": self.member.incarnation}
        self.a, self.fp, self.shapes = attacker, fp, shapes
        self.stop = threading.Event()
        self.leases = self.injected = 0
        self.held: dict[int, set[int]] = {}  # step -> microbatches leased to us (never answered)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _run(self) -> None:
        a, run = self.a, self.a.run
        sock = a.socket(a.agg_addr)
        sock.setsockopt(zmq.SNDTIMEO, 5000)
        import torch
        from cmemi.shared.config.loading import load_config
        from cmemi.shared.core.environment import environment

        from tests.conftest import DIGITS

        env = environment(torch.device("cpu"), load_config(DIGITS))  # it knows the environment, as a worker does
        protocol.send(sock, protocol.encode("hello", run, {**self.me, "fp": self.fp, "host": "evil", "env": env}))
        term = None
        while not self.stop.is_set():
            if not sock.poll(100):
                continue
            msg = protocol.decode(sock.recv_multipart(copy=False), run)
            if msg.type == "welcome":
                term = msg.header["term"]
            elif msg.type == "work":
                self.leases += 1
                h = msg.header
                mine = self.held.setdefault(h["step"], set())
                mine.update(range(h["lo"], h["hi"]))
                others = [m for m in range(4) if m not in mine]  # microbatches someone else holds: injection
                if others:
                    protocol.send(sock, protocol.encode("grad", run, {
                        **self.me, "term": term, "step": h["step"], "lo": others[0], "hi": others[0] + 1,
                        "version": h["version"], "losses": [0.0], "n": 16, "finite": True, "codec": {"name": "none"}, "encode_s": 0.0},
                        {n: torch.full(s, 5.0) for n, s in self.shapes.items()}))
                    self.injected += 1
            elif msg.type == "stop":
                return
            else:
                raise AssertionError(f"the hoarder was not admitted: {msg.header}")
            protocol.send(sock, protocol.encode("want", run, {**self.me, "term": term, "version": -1}))

    def finish(self) -> None:
        self.stop.set()
        self.join(timeout=10)
        self.member.stop()


def model_facts() -> tuple[dict[str, Any], dict[str, Any]]:
    cfg = load_config(DIGITS)
    fp = fingerprint(resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs))
    return fp, {n: tuple(p.shape) for n, p in build_model(cfg).named_parameters()}


def no_password_in_ps(c: Cluster) -> None:
    password = urlparse(c.redis_url).password
    assert password
    args = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert "-m cmemi worker" in args and "redis-server" in args, args[-2000:]  # we look at the right processes
    assert password not in args, "the Redis password is on a command line"


def checkpoint_steps(c: Cluster) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (c.run_dir / "checkpoints").glob("step-*"))


def test_hostile_clients_against_a_default_cmemi_up(tmp_path: Path, reference: str) -> None:
    fp, shapes = model_facts()
    c = Cluster(tmp_path / "run", *LONG, "cluster.workers=2", "cluster.spare_workers=0")
    stranger = hoarder = keyed = None
    try:
        c.wait_step(30, timeout=180)
        no_password_in_ps(c)
        agg_pid = int(c.redis.hgetall(c.keys.member("aggregator", "0"))["pid"])
        real_incs = [rec["incarnation"] for rec in c.members("worker").values()]
        assert len(real_incs) == 2
        rss_before = rss_mb(agg_pid)
        stranger, keyed = Attacker(c, key=None), Attacker(c, key="worker")
        # -- no key: nothing passes the handshake
        quiet = [stranger.forged_hellos(), stranger.checkpointer_attacks(stranger.term)]
        stranger.garbage(10_000)
        taken = stranger.unterminated_multipart()
        assert taken < 64 << 20, f"the aggregator read {taken} bytes from a peer that never passed the handshake"
        # -- a valid worker key: role and incarnation checks
        quiet += [keyed.forged_hellos(), keyed.checkpointer_attacks(keyed.term)]
        keyed.fence()
        hoarder = Hoarder(keyed, fp, shapes)
        hoarder.start()
        step = c.step()
        c.wait_step(step + 100, timeout=120)  # 30 s lease_timeout per step would make this impossible
        assert hoarder.error is None, hoarder.error
        assert hoarder.leases >= 20 and hoarder.injected >= 20, (hoarder.leases, hoarder.injected)
        for sock in quiet:
            replies = []
            while sock.poll(200):
                replies.append(msgpack.unpackb(sock.recv_multipart()[0]))
            assert all(r["type"] == "reject" and not r["fatal"] for r in replies), replies  # forged hellos only
            for r in replies:  # nothing the sender did not know: no real incarnation, no dataset hash
                # whole numbers: incarnations are small counters now, and "4" is inside a forged 4611686018427387904
                assert "sha256" not in r["reason"] and not any(
                    re.search(rf"(?<!\d){inc}(?!\d)", r["reason"]) for inc in real_incs), r
        rss_after = rss_mb(agg_pid)
        assert rss_after - rss_before < 100, f"aggregator RSS {rss_before:.0f} -> {rss_after:.0f} MB"
        no_password_in_ps(c)
    finally:
        if hoarder is not None:
            hoarder.finish()
        for a in (stranger, keyed):
            if a is not None:
                a.close()
        rc = c.wait()
    assert rc == 0, c.output()
    s = c.summary
    assert s["params_sha256"] == reference, "an attack changed the parameters"
    drops, ckpt_drops = s["dropped_messages"], s["checkpointer_dropped_messages"]
    assert drops.get("unregistered_incarnation", 0) >= 4, drops  # the keyed forged hellos (strangers: no entry)
    assert drops.get("wrong_role", 0) >= 1, drops  # the fence from a worker key
    assert drops.get("not_leased", 0) >= 20, drops  # the injected gradients
    assert ckpt_drops.get("wrong_role", 0) >= 33, ckpt_drops  # 11 x (crash, poison, restore_req) with a worker key
    assert max(checkpoint_steps(c)) <= 1200 and (c.run_dir / "model.safetensors").is_file()
    events = load_events(c.run_dir)
    assert not [e for e in events if e["kind"] == "checkpoint_restored"], "someone was handed the training state"
    assert not [e for e in events if e["kind"] in ("died", "fenced") and e.get("id") in ("w0", "w1")]


def test_attacks_that_need_no_key_with_curve_off(tmp_path: Path, reference: str) -> None:
    fp, shapes = model_facts()
    c = Cluster(tmp_path / "run", *LONG, "cluster.workers=2", "cluster.spare_workers=0", "security.curve=false")
    a = hoarder = None
    try:
        c.wait_step(30, timeout=180)
        no_password_in_ps(c)
        a = Attacker(c, key=None)
        a.forged_hellos()
        a.checkpointer_attacks(a.term)  # as if the term were guessed: the meta schema stops crash and poison
        a.checkpointer_attacks(a.term + 1)  # a wrong term: stale
        hoarder = Hoarder(a, fp, shapes)  # a stale or rogue process that registered in Redis
        hoarder.start()
        step = c.step()
        c.wait_step(step + 100, timeout=120)
        assert hoarder.error is None, hoarder.error
        assert hoarder.leases >= 20, hoarder.leases
    finally:
        if hoarder is not None:
            hoarder.finish()
        if a is not None:
            a.close()
        rc = c.wait()
    assert rc == 0, c.output()
    s = c.summary
    assert s["params_sha256"] == reference
    drops, ckpt_drops = s["dropped_messages"], s["checkpointer_dropped_messages"]
    assert drops.get("unregistered_incarnation", 0) >= 4 and drops.get("not_leased", 0) >= 20, drops
    assert ckpt_drops.get("bad_meta", 0) >= 22 and ckpt_drops.get("stale_term", 0) >= 33, ckpt_drops
    assert ckpt_drops.get("repeated_restore", 0) >= 11, ckpt_drops  # the aggregator asked once, at its start
    assert max(checkpoint_steps(c)) <= 1200 and (c.run_dir / "model.safetensors").is_file()
    assert len([e for e in load_events(c.run_dir) if e["kind"] == "checkpoint_restored"]) == 0
