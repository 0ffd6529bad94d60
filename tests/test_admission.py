"""Fast checks of who may say what: key roles over real CurveZMQ sockets, a hello's incarnation against a real
Redis, the checkpointer's term check and its strict snapshot-meta schema."""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import pytest
import torch
import zmq
import zmq.auth
from cmemi.services.aggregator.common.admission import registered
from cmemi.services.checkpointer.admission import TermWatch, meta_problem
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import allocate, connect
from cmemi.shared.wire import state
from cmemi.shared.wire.security import RESCAN_S, Curve, SecurityError, curve_from_config, generate


def client(ctx: zmq.Context, keys: Path, name: str, addr: str, opened: list[zmq.Socket]) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    opened.append(s)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_publickey, s.curve_secretkey = zmq.auth.load_certificate(str(keys / f"{name}.key_secret"))
    s.curve_serverkey = zmq.auth.load_certificate(str(keys / "server.key"))[0]
    s.connect(addr)
    return s


def roles_seen(router: zmq.Socket, curve: Curve, n: int, timeout: float = 20) -> list[tuple[bytes, str | None]]:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        if router.poll(100):
            frames = router.recv_multipart(copy=False)
            out.append((frames[1].bytes, curve.role(frames[1])))
    return out


def test_keys_map_to_roles_and_new_worker_keys_need_no_restart(tmp_path: Path) -> None:
    keys, other = tmp_path / "keys", tmp_path / "other"
    generate(keys)
    generate(other)  # a different cluster's keys: unknown here
    assert {p.name for p in keys.iterdir()} >= {"server.key_secret", "worker.key", "coordinator.key_secret"}
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in keys.glob("*.key_secret"))
    assert keys.stat().st_mode & 0o777 == 0o700
    ctx = zmq.Context()
    curve = Curve(True, keys, "aggregator")
    router = ctx.socket(zmq.ROUTER)
    opened: list[zmq.Socket] = [router]
    try:
        curve.serve(ctx, router)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        addr = f"tcp://127.0.0.1:{port}"
        for name in ("worker", "coordinator", "aggregator"):
            client(ctx, keys, name, addr, opened).send(name.encode())
        stranger = client(ctx, other, "worker", addr, opened)
        with contextlib.suppress(zmq.Again):  # refused: once no peer is left a blocking send would wait forever
            stranger.send(b"stranger", zmq.NOBLOCK)
        plain = ctx.socket(zmq.DEALER)
        opened.append(plain)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(addr)
        plain.send(b"plain", zmq.NOBLOCK)
        seen = dict(roles_seen(router, curve, 3))
        assert seen == {b"worker": "worker", b"coordinator": "coordinator", b"aggregator": "aggregator"}
        assert roles_seen(router, curve, 1, timeout=1.0) == []  # neither the stranger nor the plain socket got in
        # a new worker key (say, a new host) copied into the directory is accepted without a restart
        for suffix in ("key", "key_secret"):
            shutil.copy(other / f"worker.{suffix}", keys / f"worker-newhost.{suffix}")
        client(ctx, keys, "worker-newhost", addr, opened).send(b"newhost")  # ZeroMQ retries the handshake by itself
        assert roles_seen(router, curve, 1, timeout=20 + RESCAN_S) == [(b"newhost", "worker")]
    finally:
        for sock in opened:
            sock.close(linger=0)
        curve.close()
        ctx.term()


def test_curve_config_errors_name_the_fix(tmp_path: Path) -> None:
    class Sec:
        curve, keys_dir = True, None

    with pytest.raises(SecurityError, match="security.keys_dir is not set.*cmemi keys DIR"):
        curve_from_config(Sec(), "worker")
    Sec.keys_dir = str(tmp_path)
    with pytest.raises(SecurityError, match="cannot read the worker key"):
        curve_from_config(Sec(), "worker")
    Sec.curve = False
    assert curve_from_config(Sec(), "worker").role(zmq.Frame(b"x")) is None  # Curve off: no key, no role


def test_hello_incarnation_must_be_the_registered_one(redis_server) -> None:
    client_ = connect(redis_server.url)
    keys = Keys("adm")
    client_.hset(keys.member("worker", "w0"), mapping={"incarnation": "41"})
    assert registered(client_, keys, "w0", 41) is None
    assert registered(client_, keys, "w0", 2**62) == "unregistered_incarnation"
    assert registered(client_, keys, "nobody", 1) == "unregistered_incarnation"


def test_term_watch_follows_redis_and_keeps_the_last_term_when_it_is_away(redis_server) -> None:
    client_ = connect(redis_server.url)
    keys = Keys("adm")
    term = allocate(client_, keys.term)
    watch = TermWatch(client_, keys)
    assert watch.current(term) and not watch.current(term + 1) and not watch.current(term - 1)
    newer = allocate(client_, keys.term)  # a new aggregator
    assert watch.current(newer) and not watch.current(term) and not watch.unsure
    client_.delete(keys.term)  # Redis restarted empty: nothing to check a term against until it is re-advertised
    assert not watch.current(newer + 1) and watch.unsure
    client_.set(keys.term, newer)
    assert watch.current(newer) and not watch.current(newer + 1) and not watch.unsure
    redis_server.stop()
    assert watch.current(newer) and not watch.current(newer + 1) and watch.unsure  # away: only the cached term


def snapshot_header(step: int = 5, term: int = 7) -> tuple[dict, dict]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    meta, tensors = state.flatten({
        "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None,
        "rng": {"torch": torch.get_rng_state()}, "scaler": {"enabled": False},
        "progress": {"step": step, "term": term, "final_loss": float("nan"), "bytes_sent": 1, "bytes_received": 2,
                     "fingerprint": {"length": 10, "sha256": "ab"}, "skipped": 0, "wall_s": 1.5}})
    return {"step": step, "term": term, "meta": meta}, tensors


def test_snapshot_meta_schema() -> None:
    header, tensors = snapshot_header()
    assert meta_problem(header, tensors, total_steps=100) is None
    assert meta_problem({**header, "meta": {**header["meta"], "summary": {"steps": 5}}}, tensors, 100) is None
    bad = {
        "bytes": {**header["meta"], "model": b"\x00"},
        "missing section": {k: v for k, v in header["meta"].items() if k != "rng"},
        "extra section": {**header["meta"], "evil": 1},
        "missing tensor": {**header["meta"], "rng": {"torch": {"__tensor__": "nope"}}},
        "progress type": {**header["meta"], "progress": {**header["meta"]["progress"], "step": "5"}},
        "term disagrees": {**header["meta"], "progress": {**header["meta"]["progress"], "term": 8}},
        "deep": {**header["meta"], "scaler": _nested(100)},
    }
    for what, meta in bad.items():
        assert meta_problem({**header, "meta": meta}, tensors, 100) is not None, what
    far, far_tensors = snapshot_header(step=10**9)
    assert "outside the run" in meta_problem(far, far_tensors, total_steps=100)


def _nested(depth: int) -> dict:
    out: dict = {}
    for _ in range(depth):
        out = {"x": out}
    return out
