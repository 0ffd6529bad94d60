"""The hostile suite against the shards: every parameter server admits by the leader's rule (one intake,
services/aggregator/common/intake.py; one admission, services/aggregator/common/admission.py).

With `cluster.shards: 2` and a worker key and Redis credentials (what a worker host holds), each server — the
leader and shard 1 — is sent
- a hello with another dataset fingerprint (refused, fatal to the sender: `wrong_dataset`),
- a hello from another environment (refused, fatal: `wrong_environment`),
- a hello of a fenced incarnation (refused: `fenced`),
- from an admitted worker, gradients (all 5.0) for microbatches the leader never leased it: the leader drops them
  (`not_leased`), shard 1 drops them because they carry no valid lease seal (`forged_lease`);
- from the same worker, gradients for the leases the leader hands it that do not fit the model (one tensor's shape
  swapped, as another CMEMI version or model code on that host would send): the leader drops them
  (`codec_bad_shape`), and its third in a row is answered by a fatal reject naming the reason
  (services/aggregator/common/misfits.py: an honest worker would otherwise compute and be dropped forever).
Each refusal is counted in the server's drops, and the run ends with the fault-free params_sha256.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.plugins import build_model
from cmemi.shared.coordination.membership import Member
from cmemi.shared.core.environment import environment
from cmemi.shared.core.grid import Partition
from cmemi.shared.wire import assembly, protocol

from tests.conftest import DIGITS, LONG
from tests.helpers.chaos import Cluster
from tests.test_security import Attacker, model_facts

pytestmark = pytest.mark.integration
# The attack needs the run in progress while it lasts: over the same-host slots (shared/memory/shm.py) the honest workers
# finish 1200 steps in 8 s, so they take CurveZMQ tcp:// here (the attacker does anyway: it holds a worker key).
SHARDED = (*LONG, "cluster.workers=2", "cluster.spare_workers=0", "cluster.shards=2", "cluster.transport=tcp")


def ask(sock: zmq.Socket, run: str, mtype: str, fields: dict[str, Any], tensors: Any = None) -> dict[str, Any]:
    """Send one message and return the header of the reply (every hello is answered)."""
    protocol.send(sock, protocol.encode(mtype, run, fields, tensors))
    assert sock.poll(10_000), f"no reply to {mtype}"
    return protocol.decode(sock.recv_multipart(copy=False), run).header


def test_every_shard_refuses_what_the_leader_refuses(tmp_path: Path, reference: str) -> None:
    fp, _ = model_facts()
    cfg = load_config(DIGITS)
    env = environment(torch.device("cpu"), cfg)
    params = dict(build_model(cfg).named_parameters())
    pieces = Partition(params, 2).views(params, 1)  # shard 1's pieces, by name
    c = Cluster(tmp_path / "run", *SHARDED)
    a = mallory = fenced = None
    try:
        c.wait_step(30, timeout=180)
        a = Attacker(c, key="worker")
        servers = {"leader": a.agg_addr, "shard 1": c.redis.hget(c.keys.member("aggregator", "1"), "addr")}
        mallory = Member(c.redis, c.keys, "worker", "mallory", 0.1, 1.0).start()
        me = {"wid": "mallory", "inc": mallory.incarnation, "host": "evil"}
        fenced = Member(c.redis, c.keys, "worker", "trudy", 0.1, 1.0).start()
        c.redis.set(c.keys.fence("worker", "trudy"), fenced.incarnation)
        socks = {}
        for name, addr in servers.items():
            s = socks[name] = a.socket(addr)
            s.setsockopt(zmq.SNDTIMEO, 5000)
            r = ask(s, a.run, "hello", {**me, "fp": {"length": 1, "sha256": "x"}, "env": env})
            assert r["type"] == "reject" and r["fatal"] and "different dataset" in r["reason"], (name, r)
            r = ask(s, a.run, "hello", {**me, "fp": fp, "env": {**env, "torch": "0.0.1"}})
            assert r["type"] == "reject" and r["fatal"] and "different environment" in r["reason"], (name, r)
            r = ask(s, a.run, "hello", {"wid": "trudy", "inc": fenced.incarnation, "host": "evil", "fp": fp, "env": env})
            assert r["type"] == "reject" and not r["fatal"] and "fenced" in r["reason"], (name, r)
            r = ask(s, a.run, "hello", {**me, "fp": fp, "env": env})
            assert r["type"] == "welcome", (name, r)
        # admitted everywhere: gradients (all 5.0) for microbatch 0, which nobody leased to mallory. To shard 1 the
        # moment each step starts there (its answer to a pull of the next version), before the honest copy can
        # arrive: accepted, they would change the result. To the leader too (the whole model).
        shard, leader = socks["shard 1"], socks["leader"]
        term, version, injected = int(c.redis.get(c.keys.term)), c.step(), 0
        parts = assembly.Assembler(a.run, 1 << 30)
        codec = make_codec(cfg.compression)  # the run's wire encoding, as a worker's
        to_shard = codec.encode({n: torch.full(p.shape, 5.0) for n, p in pieces.items()}, 0)
        to_leader = codec.encode({n: torch.full(p.shape, 5.0) for n, p in params.items()}, 0)
        while injected < 20:
            protocol.send(shard, protocol.encode("pull", a.run, {**me, "term": term, "version": version + 1}))
            while True:
                assert shard.poll(10_000), "shard 1 does not answer an admitted worker's pull"
                r = parts.recv(shard)  # a slice may come in parts (shared/wire/assembly.py)
                if r is not None and r.type == "slice" and r.header["asked"] == version + 1:
                    break
            version = r.header["version"]
            grad = {**me, "term": term, "step": version, "lo": 0, "hi": 1, "version": version, "losses": [0.0],
                    "n": 16, "finite": True, "encode_s": 0.0, "lease": b"\0" * 16}
            protocol.send(shard, protocol.encode("grad", a.run, {**grad, "codec": to_shard[0]}, to_shard[1]))
            protocol.send(leader, protocol.encode("grad", a.run, {**grad, "codec": to_leader[0]}, to_leader[1]))
            injected += 1
        rejected = misfits(a, leader, me, term, Partition(params, 2).views(params, 0))
        protocol.send(leader, protocol.encode("leave", a.run, {"wid": "mallory", "inc": mallory.incarnation}))
    finally:
        for member in (mallory, fenced):
            if member is not None:
                member.stop()
        if a is not None:
            a.close()
        rc = c.wait()
    assert rc == 0, c.output()
    s = c.summary
    assert s["params_sha256"] == reference, "an attack changed the parameters"
    for name, drops in (("leader", s["dropped_messages"]), ("shard 1", s["shards"][1]["dropped_messages"])):
        assert drops.get("wrong_dataset", 0) >= 1 and drops.get("wrong_environment", 0) >= 1, (name, drops)
        assert drops.get("fenced", 0) >= 1, (name, drops)
    assert s["dropped_messages"].get("not_leased", 0) >= 1, s["dropped_messages"]
    assert s["shards"][1]["dropped_messages"].get("forged_lease", 0) == 20, s["shards"][1]  # every one, whatever its step
    assert rejected.startswith("the aggregator dropped 3 gradients in a row of worker mallory as codec_bad_shape")
    assert rejected.endswith("run the same CMEMI version, model code and config on every host"), rejected
    assert s["dropped_messages"].get("codec_bad_shape", 0) >= 3, s["dropped_messages"]


def misfits(a: Attacker, leader: zmq.Socket, me: dict[str, Any], term: int,
            params: dict[str, torch.Tensor]) -> str:
    """Ask the leader for work like a worker; answer every lease with a gradient of its pieces whose first matrix has
    its shape swapped. Returns the leader's fatal reject (the reason). (Shard 1 runs the same rule on its slice, but
    a test client cannot beat the honest worker handed the same lease again to it: the shard keeps the first copy.)"""
    codec = make_codec(load_config(DIGITS).compression, flat=False)  # tensor by tensor: each names its shape
    info, frames = codec.encode({n: torch.zeros(p.shape) for n, p in params.items()}, 0)
    first = next(n for n in info if len(info[n]["shape"]) == 2)
    info[first]["shape"] = info[first]["shape"][::-1]
    parts = assembly.Assembler(a.run, 1 << 30)
    protocol.send(leader, protocol.encode("want", a.run, {**me, "term": term, "version": -1}))
    for _ in range(200):  # leases until the leader rejects us (each is answered: work, pending or the reject)
        assert leader.poll(10_000), "no answer from the leader"
        if (r := parts.recv(leader)) is None:
            continue
        if r.type == "reject":
            return r.header["reason"]
        if r.type == "work":
            h = r.header
            protocol.send(leader, protocol.encode("grad", a.run, {
                **me, "term": term, "step": h["step"], "lo": h["lo"], "hi": h["hi"], "version": h["version"],
                "losses": [0.0] * (h["hi"] - h["lo"]), "n": 16, "finite": True, "encode_s": 0.0,
                "lease": h.get("lease", b""), "codec": info}, frames))
        elif r.type == "pending":
            protocol.send(leader, protocol.encode("want", a.run, {**me, "term": term, "version": -1}))
    raise AssertionError("the leader never rejected a worker whose gradients do not fit")
