"""In-process rigs for the aggregator's unit tests: a `ServiceContext` on a real Redis (no process started), and
peers played by real ZeroMQ sockets — a checkpointer on a thread of the test that answers each snapshot from a
script, and a worker or a leader as a plain DEALER or ROUTER the test drives itself. No sleeps: every wait polls a
socket with a deadline."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import zmq
from cmemi.shared.config.loading import load_config
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits, protocol
from cmemi.shared.wire.security import curve_from_config

from tests.conftest import DIGITS


def context(tmp_path: Path, redis_url: str, *sets: str, name: str = "rig", config: str = DIGITS) -> ServiceContext:
    """A service's context as `start_service` builds it, without signal handlers, metrics or a process of its own:
    plain tcp:// (no same-host slots), no CurveZMQ, ports 0."""
    run_dir = tmp_path / name
    cfg = load_config(config, [f"run.name={name}", f"run.dir={run_dir}", "cluster.host=127.0.0.1",
                               "security.curve=false", "cluster.transport=tcp", *sets])
    run_dir.mkdir(parents=True, exist_ok=True)
    return ServiceContext(cfg, connect(redis_url), Keys(name), name, structlog.get_logger().bind(service="rig"),
                          argparse.Namespace(), threading.Event(), {}, curve_from_config(cfg.security, "aggregator"))


def until(condition: Callable[[], Any], timeout: float, what: str, step: Callable[[], Any] = lambda: None) -> Any:
    """Run `step` until `condition()` holds (returned) or `timeout` seconds pass (AssertionError naming `what`).
    `step` must wait itself (a socket's poll), so this never spins."""
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        step()
    return got


class PlayedCheckpointer:
    """A checkpointer's ROUTER, advertised in Redis: `restore_req` is answered `no_checkpoint` (or the restore
    `restore` returns), each snapshot with the next of `answers` ("retry", "saved", "skipped"; "saved" once they
    run out). `snapshots` lists the steps of the snapshots received, whole, in order (a resend counts again). The
    step log (checkpoint.step_log): each entry is held and acknowledged (`logged`: its steps, in order), and a
    replay's `log_req` is answered `log_end` (it holds no log from before the test). `acks_when(step)`: an entry's
    `logged` is held back until it returns True (checked on the checkpointer's thread, every 20 ms at most); `acked`
    lists the steps acknowledged, in order."""

    def __init__(self, ctx: ServiceContext, answers: list[str] | None = None,
                 acks_when: Callable[[int], bool] | None = None) -> None:
        self.ctx, self.answers, self.acks_when = ctx, list(answers or []), acks_when
        self.snapshots: list[int] = []
        self.logged: list[int] = []
        self.acked: list[int] = []
        self.held: list[tuple[bytes, int]] = []
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(ctx.cfg), ctx.cfg.cluster.checksum, peers=4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="played-checkpointer", daemon=True)
        ctx.redis.hset(ctx.keys.checkpointer, mapping={"addr": self.addr, "incarnation": "1", "log": self.addr})
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._release()
            if not self.sock.poll(20):
                continue
            identity, *frames = self.sock.recv_multipart(copy=False)
            msg = self.parts.decode(identity.bytes, frames)
            if msg is None:
                continue
            if msg.type == "restore_req":
                self._reply(identity.bytes, "no_checkpoint", {"term": msg.header["term"]})
            elif msg.type == "step_log":
                self.logged.append(msg.header["step"])
                self.held.append((identity.bytes, msg.header["step"]))
                self._release()
            elif msg.type == "log_req":
                self._reply(identity.bytes, "log_end", {"after": msg.header["after"]})
            elif msg.type == "snapshot":
                step = msg.header["step"]
                self.snapshots.append(step)
                answer = self.answers.pop(0) if self.answers else "saved"
                self._reply(identity.bytes, answer, {"step": step, **({"path": f"ckpt-{step}"}
                                                                       if answer == "saved" else {})})

    def _release(self) -> None:
        while self.held and (self.acks_when is None or self.acks_when(self.held[0][1])):
            identity, step = self.held.pop(0)
            self.acked.append(step)
            self._reply(identity, "logged", {"step": step})

    def _reply(self, identity: bytes, mtype: str, fields: dict[str, Any]) -> None:
        protocol.send(self.sock, protocol.encode(mtype, self.ctx.run, fields), identity)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)
        self.zctx.term()


class Peer:
    """A worker or a leader as the test plays it: a real ZeroMQ socket, whole messages in (reassembled from parts)
    and out. `identity`: for a ROUTER, the peer it last heard from."""

    def __init__(self, ctx: ServiceContext, sock: zmq.Socket) -> None:
        self.ctx, self.sock, self.identity = ctx, sock, b""
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(ctx.cfg), ctx.cfg.cluster.checksum, peers=4)

    def send(self, mtype: str, fields: dict[str, Any], tensors: dict[str, Any] | None = None,
             encoded: Any = None) -> None:
        routed = self.sock.type == zmq.ROUTER
        protocol.send(self.sock, protocol.encode(mtype, self.ctx.run, fields, tensors, encoded=encoded),
                      self.identity if routed else None)

    def expect(self, *types: str, timeout: float = 10) -> protocol.Message:
        """The next whole message of one of `types` (others are skipped); AssertionError if none comes in time."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            frames = self.sock.recv_multipart(copy=False)
            if self.sock.type == zmq.ROUTER:
                self.identity, frames = frames[0].bytes, frames[1:]
            msg = self.parts.decode(self.identity, frames)
            if msg is not None and msg.type in types:
                return msg
        raise AssertionError(f"no {' or '.join(types)} within {timeout:g}s")

    def quiet(self, timeout: float) -> bool:
        """Nothing arrives within `timeout` seconds."""
        return not self.sock.poll(int(timeout * 1000))
