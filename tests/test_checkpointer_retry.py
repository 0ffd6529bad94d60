"""A snapshot the checkpointer cannot check is asked for again, not lost: with Redis restarted empty (or away) the
checkpointer does not know the current term, drops the snapshot and answers `retry`; the aggregator sends it again
(services/aggregator/snapshots/send.py), and once the term is back it is written. Before, the drop was silent and the
aggregator waited for an answer that never came (the final checkpoint timed out after 300 s in the fault test that
kills the checkpointer and Redis close together). A real `cmemi checkpointer`, real Redis, real sockets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import zmq
from cmemi.shared.config.loading import dump_config, load_config
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.wire import assembly, security, transfer

from tests.conftest import DIGITS, ROOT
from tests.helpers.chaos import poll
from tests.test_admission import snapshot_header

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_snapshot_of_an_unknown_term_is_asked_for_again_then_written(tmp_path: Path, redis_server) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(DIGITS, ["run.name=ckptretry", f"run.dir={run_dir}", "cluster.host=127.0.0.1",
                               "security.curve=false", "train.steps=100"])
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    keys, r = Keys("ckptretry"), redis.Redis.from_url(redis_server.url, decode_responses=True)
    log = (tmp_path / "ckpt.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "cmemi", "checkpointer", "--config", str(run_dir / "config.yaml")],
                            cwd=ROOT, env={**os.environ, "CMEMI_REDIS_URL": redis_server.url}, stdout=log, stderr=log)
    ctx = zmq.Context()
    try:
        poll(lambda: r.hget(keys.checkpointer, "addr"), 60, "the checkpointer listening")
        sock = ctx.socket(zmq.DEALER)
        security.Curve(False, tmp_path, "aggregator").connect_as_client(sock)
        sock.connect(r.hget(keys.checkpointer, "addr"))
        header, tensors = snapshot_header(step=5, term=7)

        def send() -> dict:
            transfer.send(sock, transfer.messages("snapshot", "ckptretry", {**header, "final": False}, 1 << 26, tensors))
            assert sock.poll(30_000), "no answer to a snapshot"
            reply = assembly.Assembler("ckptretry", 1 << 20).decode(b"", sock.recv_multipart())
            assert reply is not None
            return {"type": reply.type, **reply.header}

        assert r.get(keys.term) is None  # Redis as after a restart: no term yet
        reply = send()
        assert (reply["type"], reply["step"]) == ("retry", 5), reply
        r.set(keys.term, 6)  # a term is known, and it is not the snapshot's: a stale aggregator gets no answer
        transfer.send(sock, transfer.messages("snapshot", "ckptretry", {**header, "final": False}, 1 << 26, tensors))
        assert not sock.poll(1_000), "a stale term's snapshot is answered"
        r.set(keys.term, 7)  # the aggregator re-advertised its term
        reply = send()
        assert reply["type"] == "saved" and reply["step"] == 5, reply
        assert (run_dir / "checkpoints" / "step-00000005").is_dir()
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
