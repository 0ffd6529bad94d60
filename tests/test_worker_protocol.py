"""A real worker process against a scripted aggregator (a ROUTER socket in the test): parameters land in
the model in place, and a corrupted reply makes the worker ask again for a full set instead of hanging."""

from __future__ import annotations

import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from cmemi.shared.compression.dense import NoneCodec
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect
from cmemi.shared.core.data import fetch, microbatch_indices, microbatch_seed
from cmemi.shared.wire import assembly, protocol, transfer
from cmemi.shared.wire.layout import Layout

from tests.conftest import DIGITS, ROOT, cmemi_cmd

pytestmark = pytest.mark.integration

RUN = "scripted"
TERM = 7


def recv(router: zmq.Socket, timeout: float = 60) -> tuple[bytes, protocol.Message]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.poll(100):
            frames = router.recv_multipart(copy=False)
            return frames[0].bytes, protocol.decode(frames[1:], RUN)
    raise TimeoutError("the worker sent nothing")


def flat(params: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The fields and frames of parameters as an aggregator sends a small model's: flat (shared/wire/layout.py)."""
    layout = Layout(params)
    assert layout.flat
    return {"term": TERM, "step": 0, "lo": 0, "hi": 1, "version": 0, "scale": 1.0, "layout": layout.digest}, \
        layout.pack(params)


def work(params: dict[str, torch.Tensor], corrupt: bool = False) -> list:
    parts = protocol.encode("work", RUN, *flat(params))
    if corrupt:  # one flipped byte in the middle of the largest tensor: its checksum no longer matches
        i = max(range(1, len(parts)), key=lambda j: parts[j].nbytes)
        data = bytearray(parts[i])
        data[len(data) // 2] ^= 0xFF
        parts[i] = data
    return parts


@contextmanager
def scripted_worker(redis_server, tmp_path: Path, *sets: str, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """A real worker w0 (Curve off: a plain ROUTER plays the aggregator) and that ROUTER: (router, proc)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    addr = protocol.bind(router, "127.0.0.1", 0)
    connect(redis_server.url).hset(Keys(RUN).aggregator, mapping={"addr": addr, "term": TERM})
    extra = [a for kv in sets for a in ("--set", kv)]
    proc = subprocess.Popen(cmemi_cmd("worker", "--config", DIGITS, "--redis", redis_server.url, "--worker-id", "w0",
                                      "--set", f"run.name={RUN}", "--set", f"run.dir={tmp_path / 'run'}",
                                      "--set", "security.curve=false", *extra),
                            cwd=ROOT, stdout=stdout, stderr=stderr, text=True)
    try:
        yield router, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        ctx.destroy(linger=0)


def welcome(router: zmq.Socket) -> bytes:
    """Take the worker's hello, welcome it at step 0; returns its identity."""
    ident, msg = recv(router)
    assert msg.type == "hello" and msg.header["wid"] == "w0"
    protocol.send(router, protocol.encode("welcome", RUN, {"term": TERM, "step": 0, "version": 0, "total_steps": 1}),
                  ident)
    return ident


def stop(router: zmq.Socket, ident: bytes, redis_url: str) -> None:
    """As the leader ends a run: "stop", then the run marked completed (a worker leaves once it is)."""
    protocol.send(router, protocol.encode("stop", RUN, {"reason": "test over"}), ident)
    connect(redis_url).set(Keys(RUN).state, "completed")


def halved_params_and_loss() -> tuple[dict[str, torch.Tensor], float]:
    """Parameters the worker cannot have built itself, and the loss of microbatch (0, 0) with them."""
    cfg = load_config(DIGITS, [f"run.name={RUN}"])
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    ds = resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs)
    x, y = fetch(ds, microbatch_indices(cfg.run.seed, len(ds), cfg.train.global_batch, cfg.train.microbatches, 0, 0))
    torch.default_generator.manual_seed(microbatch_seed(cfg.run.seed, 0, 0))
    loss = float(resolve(cfg.train.loss, "train.loss")(model(x), y).detach())
    return {n: p.detach() for n, p in model.named_parameters()}, loss


def test_corrupted_parameters_are_dropped_and_asked_for_again(redis_server, tmp_path: Path) -> None:
    params, expected_loss = halved_params_and_loss()
    with open(tmp_path / "worker.log", "w") as log, \
            scripted_worker(redis_server, tmp_path, stdout=log, stderr=subprocess.STDOUT) as (router, proc):
        ident = welcome(router)
        ident, msg = recv(router)
        assert msg.type == "want" and msg.header["version"] == -1
        router.send_multipart([ident, *work(params, corrupt=True)])
        ident, msg = recv(router)  # the bad message was dropped; the worker holds no valid version now
        assert msg.type == "want" and msg.header["version"] == -1, msg.header
        protocol.send(router, work(params), ident)
        ident, msg = recv(router)
        assert msg.type == "grad" and (msg.header["step"], msg.header["lo"], msg.header["hi"], msg.header["version"]) == (0, 0, 1, 0)
        assert msg.header["losses"][0] == pytest.approx(expected_loss, rel=1e-6)
        stop(router, ident, redis_server.url)
        assert proc.wait(timeout=60) == 0
    assert "bad_checksum" in (tmp_path / "worker.log").read_text()


def test_a_lost_reply_costs_a_round_trip_and_messages_over_the_cap_travel_in_parts(redis_server,
                                                                                   tmp_path: Path) -> None:
    """The scripted aggregator ignores the worker's first request: the worker asks again after a timeout, not
    never. With cluster.max_message_bytes=65536, the parameters (~105 kB) reach it in parts, land in its model
    (the loss proves it), and its gradient comes back in parts, each ZeroMQ message under the cap."""
    cap = 65536
    params, expected_loss = halved_params_and_loss()
    with scripted_worker(redis_server, tmp_path, f"cluster.max_message_bytes={cap}") as (router, proc):
        welcome(router)
        ident, msg = recv(router)
        assert msg.type == "want"  # its reply is "lost": nothing is sent back
        ident, msg = recv(router, timeout=30)
        assert msg.type == "want", msg.header  # asked again by itself
        fields, frames = flat(params)
        sent = transfer.messages("work", RUN, fields, cap, frames)
        assert len(sent) >= 2
        transfer.send(router, sent, ident)
        asm, grad, sizes = assembly.Assembler(RUN, bound=1 << 30), None, []
        deadline = time.monotonic() + 60
        while grad is None and time.monotonic() < deadline:
            if router.poll(100):
                frames = router.recv_multipart(copy=False)
                sizes.append(protocol.message_bytes(frames[1:]))
                grad = asm.decode(frames[0].bytes, frames[1:])
        assert grad is not None and grad.type == "grad", "no gradient"
        assert len(sizes) >= 2 and max(sizes) <= cap, sizes
        assert grad.header["losses"][0] == pytest.approx(expected_loss, rel=1e-6)
        grads = NoneCodec().decode(grad.header["codec"], grad.tensors, shapes={n: p.shape for n, p in params.items()})
        assert all(grads[n].shape == p.shape for n, p in params.items())
        stop(router, ident, redis_server.url)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]


def test_a_gradient_whose_header_alone_is_over_the_cap_stops_the_worker(redis_server, tmp_path: Path) -> None:
    """1,500 more parameter tensors of 3,000 elements (too big for a flat buffer): the gradient's header (its tensor
    table) leaves no room for a chunk under cluster.max_message_bytes=65536. Nothing is sent; the worker stops with
    one line naming size and cap (exit 2)."""
    with scripted_worker(redis_server, tmp_path, "model.factory=tests.helpers.fixtures:many_tensors_mlp",
                         "model.kwargs={size: 3000}", "cluster.max_message_bytes=65536") as (router, proc):
        welcome(router)
        ident, msg = recv(router)
        assert msg.type == "want"
        protocol.send(router, protocol.encode("work", RUN, {"term": TERM, "step": 0, "lo": 0, "hi": 1, "version": -1,
                                                            "scale": 1.0}, {}), ident)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err[-2000:]
        line = [x for x in err.splitlines() if x.startswith("cmemi: error:")][-1]
        assert "'grad' message of" in line and "exceeds cluster.max_message_bytes=65536" in line, line
        assert "header alone" in line, line
        assert not router.poll(200), "something of the gradient was sent"


def test_parameters_of_another_model_stop_the_worker_with_one_line(redis_server, tmp_path: Path) -> None:
    """Checksums pass, but the flat layout is another model's (a config that differs between hosts): exit 2."""
    params, _ = halved_params_and_loss()
    other = {**params, "extra.weight": torch.zeros(3)}
    with scripted_worker(redis_server, tmp_path) as (router, proc):
        ident = welcome(router)
        ident, msg = recv(router)
        assert msg.type == "want"
        protocol.send(router, protocol.encode("work", RUN, *flat(other)), ident)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err[-2000:]
        lines = [x for x in err.splitlines() if x.startswith("cmemi: error:")]
        assert len(lines) == 1 and "do not fit this worker's model" in lines[0] and "model.kwargs" in lines[0], err
