"""Local steps (train.local_steps, DiLoCo; docs/design.md §10): the config's refusals, a replica's round against a
synchronous step, the leader's check of a replica's inner state, and real clusters bitwise equal to `cmemi reference`
for any W and K, with a codec, a BatchNorm model, and every role SIGKILLed mid-round."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.services.aggregator.common.replicas import Holdings, InnerStates
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.worker.compute.local import LocalRound
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import config_from_dict, load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model
from cmemi.shared.core import innerstate
from cmemi.shared.wire import samehost

from tests.conftest import DIGITS, ROOT, cmemi_cmd, run_up
from tests.helpers import references
from tests.helpers.chaos import Cluster
from tests.test_supervision import redis_pid

LOCAL = ("train.local_steps=5", "train.replicas=4", "train.steps=60", "scheduler.kwargs.T_max=60",
         "cluster.spare_workers=0", "checkpoint.every_steps=0", "eval.every_steps=4")


def reference(tmp_path: Path, *sets: str, config: str = DIGITS) -> dict:
    """`cmemi reference`'s summary, once per config per session (tests/helpers/references.py)."""
    return references.reference(tmp_path, *sets, config=config)


def digits(*sets: str):
    return load_config(DIGITS, list(sets))


# ---------------------------------------------------------------------------------------------- config (unit)

@pytest.mark.parametrize("sets, field", [
    (("train.local_steps=5", "train.steps=12"), "train.steps"),
    (("train.replicas=4",), "train.replicas"),
    (("train.local_steps=-1",), "train.local_steps"),
    (("train.local_steps=5", "precision=fp16"), "precision"),
    (("train.local_steps=5", "cluster.shards=2", "cluster.pipeline_stages=2"), "cluster.pipeline_stages"),
    (("train.local_steps=6", "train.fragments=2", "compression.downlink=int8"), "compression.downlink"),  # streaming
    (("train.local_steps=5", "compression.codec=topk"), "compression.codec"),
    (("train.local_steps=5", "cluster.shards=2", "outer_optimizer.name=LBFGS", "outer_optimizer.kwargs={lr: 1.0}"),
     "outer_optimizer.name"),
    (("train.local_steps=5", "outer_optimizer.name=AdamW"), "outer_optimizer.kwargs"),  # SGD's momentum is no AdamW's
    (("train.local_steps=5", "outer_optimizer.param_groups=[{lr: 1.0}]"), "outer_optimizer.param_groups\\[0\\]"),
    (("train.local_steps=5", "train.fragments=2", "train.steps=10"), "train.fragments"),  # must divide H
    (("train.fragments=2",), "train.fragments"),  # fragments of no round
    (("train.fragments=0",), "train.fragments"),
    (("train.local_steps=6", "train.fragments=2", "train.steps=12", "train.fragment_mix=1.5"), "train.fragment_mix"),
])
def test_local_steps_refuse_what_they_cannot_keep_exact(sets: tuple[str, ...], field: str) -> None:
    with pytest.raises(ConfigError, match=f"config field '{field}'"):
        digits("train.steps=300", *sets) if "train.steps=12" not in sets else digits(*sets)


def test_whole_rounds_take_a_downlink_and_streaming_says_why_not() -> None:
    """compression.downlink with whole rounds: a replica's round starts from the mirror m_t (docs/design.md §10), so
    every downlink codec is accepted; streaming is refused with its reason (a segment takes 1/F of θ down already)."""
    for down in ("bf16", "int8", "topk", "powersgd", "sign", "int4", "int2"):
        cfg = digits("train.steps=300", "train.local_steps=5", f"compression.downlink={down}")
        assert cfg.compression.downlink == down and Trainer(cfg).mirror is not None
    with pytest.raises(ConfigError, match="config field 'compression.downlink'.*1/F of the parameters"):
        digits("train.steps=300", "train.local_steps=6", "train.fragments=3", "compression.downlink=int8")


def test_a_replica_is_a_lease_and_rounds_count_the_servers_steps() -> None:
    cfg = digits("train.local_steps=10", "train.replicas=8", "train.steps=300")
    assert cfg.train.microbatches == 8 and cfg.train.rounds == 30 and cfg.train.samples_per_round == 640
    assert cfg.outer_optimizer.name == "SGD" and cfg.outer_optimizer.kwargs == {"lr": 0.7, "momentum": 0.9,
                                                                                "nesterov": True}
    named = config_from_dict({**_raw(), "outer_optimizer": {"name": "SGD"}})  # a section naming SGD keeps the paper's
    assert named.outer_optimizer.kwargs == cfg.outer_optimizer.kwargs
    sync = digits()
    assert sync.train.rounds == sync.train.steps and sync.train.samples_per_round == sync.train.global_batch
    # the servers step the outer optimizer, with no schedule; a sharded inner optimizer need not be elementwise
    t = Trainer(cfg)
    assert t.scheduler is None and type(t.optimizer).__name__ == "SGD" and t.optimizer.defaults["lr"] == 0.7
    config_from_dict({**_raw(), "train": {**_raw()["train"], "local_steps": 5, "steps": 300},
                      "optimizer": {"name": "LBFGS", "kwargs": {"lr": 1.0}}, "cluster": {"shards": 2}})


def _raw() -> dict:
    import yaml

    return yaml.safe_load(Path(DIGITS).read_text())


# ---------------------------------------------------------------------------------------------- a round (unit)

def _runner(cfg) -> MicrobatchRunner:
    return MicrobatchRunner(cfg, build_model(cfg), resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs),
                            resolve(cfg.train.loss, "train.loss"))


def test_one_replica_one_local_step_and_a_plain_outer_step_is_a_synchronous_step() -> None:
    """H = 1, R = 1, outer SGD with lr 1 and no momentum: θ − (θ − θ_r) = θ_r, a synchronous step on microbatch (s, 0)
    of M = 1 (equal up to the rounding of the subtraction)."""
    sets = ("train.microbatches=1", "model.kwargs.dropout=0.0", "scheduler.name=null")
    local = digits(*sets, "train.local_steps=1", "train.steps=3", "outer_optimizer.kwargs={lr: 1.0}")
    sync = digits(*sets, "train.steps=3")
    runner = _runner(local)
    rnd = LocalRound(local, runner)
    theta = {n: p.detach().clone() for n, p in runner.params.items()}
    loss, delta, _, state = rnd.run(0, 0, None)
    assert all(torch.equal(p, theta[n]) for n, p in runner.params.items())  # θ again, for the next replica
    assert state["optimizer"]["state"] and state["scheduler"] is None  # momentum buffers, after one step
    t = Trainer(sync)
    srunner = _runner(sync)
    _, grads, _ = srunner.run(0, 0)
    t.apply(grads)
    outer = Trainer(local)
    outer.apply(delta)
    for n, p in outer.params.items():
        torch.testing.assert_close(p, t.params[n], rtol=0, atol=1e-6)


def test_a_round_reads_its_replicas_data_and_carries_state_to_the_next() -> None:
    """Replicas differ (their own data), a replica's round is the same bits wherever it is computed, and its second
    round starts from the state its first ended with."""
    cfg = digits("train.local_steps=3", "train.replicas=2", "train.steps=30", "optimizer.name=AdamW",
                 "optimizer.kwargs={lr: 0.001}")
    a, b = LocalRound(cfg, _runner(cfg)), LocalRound(cfg, _runner(cfg))
    _, d0, _, s0 = a.run(0, 0, None)
    _, d1, _, _ = a.run(0, 1, None)
    _, again, _, s0b = b.run(0, 0, None)
    assert any(not torch.equal(d0[n], d1[n]) for n in d0)
    assert all(torch.equal(d0[n], again[n]) for n in d0)
    wired = innerstate.through_wire(s0)
    _, next_a, _, _ = a.run(1, 0, wired)
    _, next_b, _, _ = b.run(1, 0, s0b)
    _, fresh, _, _ = b.run(1, 0, None)
    assert all(torch.equal(next_a[n], next_b[n]) for n in next_a)
    assert any(not torch.equal(next_a[n], fresh[n]) for n in next_a)
    assert int(wired["optimizer"]["state"][0]["step"]) == 3  # three inner steps, kept


def test_the_leader_keeps_only_a_well_formed_inner_state() -> None:
    """A replica's state is checked against this model's layout before it is kept; what is malformed is a drop."""
    cfg = digits("train.local_steps=2", "train.replicas=2", "train.steps=20")
    runner = _runner(cfg)
    _, _, _, state = LocalRound(cfg, runner).run(0, 1, None)
    store = InnerStates(2)
    store.expect(innerstate.layout_of(cfg, {n: (p.shape, p.dtype) for n, p in runner.params.items()}))
    meta, tensors = innerstate.to_wire(state)
    good, reason = store.parse(1, meta, tensors)
    assert reason is None
    name = next(iter(tensors))
    nan = {**tensors, name: torch.full_like(tensors[name], float("nan"))}
    wrong = {**tensors, name: tensors[name][:1].clone()}
    regrouped = innerstate.through_wire(state)  # a param group naming other parameters: would load wrongly
    regrouped["optimizer"]["param_groups"][0]["params"] = [1, 0, *regrouped["optimizer"]["param_groups"][0]["params"][2:]]
    other = innerstate.to_wire(regrouped)[0]
    for r, m, t in ((2, meta, tensors), (1, {}, tensors), (1, {"x": 1}, tensors), (1, meta, nan), (1, meta, wrong),
                    (1, meta, {**tensors, "model.w": tensors[name]}), (1, meta, {}), (1, other, tensors)):
        assert store.parse(r, m, t) == (None, "bad_inner")
    store.keep(1, good)
    assert store.current[1] is None
    store.advance()  # the round applied: replica 1's next round starts from it; replica 0's is still fresh
    assert store.current[0] is None and store.current[1] is good and list(store.state_dict()) == [1]
    fresh = InnerStates(2)
    fresh.load_state_dict(store.state_dict())
    assert fresh.current[1] is good and fresh.wire(0) == ({}, {})


def test_the_reference_sums_the_replicas_by_the_tree_and_the_collector_leases_held_replicas_first() -> None:
    c = StepCollector(0, 4, block=1)
    assert c.lease("w0", 1, 0.0, 10.0, prefer={2}) == (2, 3)
    assert c.lease("w1", 1, 0.0, 10.0, prefer={2}) == (0, 1)  # taken already: the queue's order
    # streaming: a replica another worker holds is never leased elsewhere; with nothing else pending, none is
    assert c.lease("w2", 1, 0.0, 10.0, avoid={1}) == (3, 4)
    assert c.lease("w2", 1, 0.0, 10.0, avoid={1}) is None and c.pending
    assert c.lease("w3", 1, 0.0, 10.0, prefer={1}, avoid={1}) == (1, 2)


def test_holdings_keep_replicas_with_their_holders_but_share_out_extras() -> None:
    """Streaming: a replica another admitted worker holds for this round is avoided; a worker holding fewer than its
    fair share may take the others' extras beyond theirs (their highest), so a worker that joined late gets work; a
    holder not heard from within the patience (hung while it heartbeats) holds nothing back."""
    h = Holdings(4)
    everyone = lambda _i: True  # noqa: E731
    h.note(b"a", [[0, 5], [1, 5], [2, 5]], everyone)
    h.note(b"b", [[3, 5]], everyone)
    assert h.elsewhere(b"b", 5, everyone, 1, 60.0) == {0, 1, 2}  # b holds its share: everything a holds waits for a
    assert h.elsewhere(b"b", 5, everyone, 2, 60.0) == {0, 1}  # b holds less: a's extra beyond 2 (replica 2) is free
    assert h.elsewhere(b"c", 5, everyone, 2, 60.0) == {0, 1, 3}
    assert h.elsewhere(b"c", 6, everyone, 2, 60.0) == set()  # another round: nothing held
    assert h.elsewhere(b"c", 5, lambda i: i != b"a", 2, 60.0) == {3}  # a is gone: its replicas go to whoever asks
    h.heard[b"a"] -= 120.0  # a is admitted (it heartbeats) but has not asked for two minutes: it hangs
    assert h.elsewhere(b"c", 5, everyone, 2, 60.0) == {3}


def test_a_worker_is_leased_first_the_replicas_whose_state_a_server_on_its_host_keeps() -> None:
    """K = 2 (replica r's state on shard r mod 2): a worker whose `want` says shard 1 runs on its host prefers replicas
    1 and 3, but not one another worker holds for the round; a `near` that is not a list of shard numbers is none, and
    a departed worker's goes with it."""
    h = Holdings(4, keeper=lambda r: r % 2)
    everyone = lambda _i: True  # noqa: E731
    h.note(b"a", [], everyone, near=[1])
    h.note(b"b", [[3, 0]], everyone, near=[0, "x", 7])
    assert h.nearby(b"a", 0) == {1}  # (3: b holds it)
    assert h.nearby(b"b", 0) == {0, 2}
    assert h.nearby(b"a", 1) == {1, 3}  # b holds round 0's state of 3, not round 1's
    h.note(b"c", [], everyone, near="1")
    assert h.nearby(b"c", 0) == set()
    assert h.nearby(b"d", 0) == set()  # (said nothing)
    h.note(b"c", [], lambda i: i != b"a", near=[0, 1])
    assert b"a" not in h.near
    assert h.nearby(b"c", 0) == {0, 1, 2}


def test_the_servers_on_this_host_are_those_whose_address_names_its_identity() -> None:
    here = samehost.advertise("tcp://10.0.0.1:5", "ipc:///run/a.sock")
    elsewhere = "tcp://10.0.0.2:5|ipc:///run/b.sock|0123456789abcdef"
    assert samehost.on_this_host({0: here, 1: elsewhere, 2: "tcp://10.0.0.3:5", 3: None, 4: here}) == [0, 4]


# ---------------------------------------------------------------------------------------------- clusters

@pytest.mark.integration
@pytest.mark.timeout(600)
def test_local_steps_give_the_reference_for_any_workers_shards_codec_and_a_batchnorm_model(tmp_path: Path) -> None:
    """W = 1, 4 at K = 1 and W = 2 at K = 2, 3 over 12 rounds of 5 inner steps of 4 replicas (digits, dropout, SGD with
    Nesterov inside, the default outer step): one params_sha256, the reference's, and its evaluations (every 4 rounds),
    and `cmemi status` counts rounds; one worker is never sent a replica's state (it keeps them all). int8 changes at W = 2: the int8
    reference's. The ResNet example (BatchNorm statistics carried through a replica's inner steps and averaged,
    augmentation) with AdamW inside at K = 2, W = 2: its reference's."""
    ref = reference(tmp_path, *LOCAL)
    want = ref["params_sha256"]
    assert [e["step"] for e in ref["eval_history"]] == [4, 8]
    got = {}
    for k, w in ((1, 1), (1, 4), (2, 2), (3, 2)):
        r = run_up(tmp_path / f"k{k}w{w}", *LOCAL, f"cluster.shards={k}", f"cluster.workers={w}")
        assert r.rc == 0, r.stderr[-3000:]
        got[(k, w)] = r.summary["params_sha256"]
        assert r.summary["steps"] == 12
        assert set(r.summary["dropped_messages"]) <= {"duplicate", "stale_step"}, r.summary
        assert "round   12/12 (inner step 60/60)" in r.stdout, r.stdout[-500:]
        assert r.summary["eval_history"] == ref["eval_history"]
        if w == 1:  # one worker holds every replica's state from round to round: none is ever sent down
            assert r.summary["inner_states_sent"] == 0, r.summary
    assert set(got.values()) == {want}, got
    status = subprocess.run(cmemi_cmd("status", str(tmp_path / "k3w2")), cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert "round 12/12 (inner step 60/60)" in status.stdout, status.stdout + status.stderr
    int8 = (*LOCAL, "compression.codec=int8")
    r = run_up(tmp_path / "int8", *int8, "cluster.workers=2")
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary["params_sha256"] == reference(tmp_path, *int8)["params_sha256"] != want
    resnet = str(ROOT / "examples" / "resnet.yaml")
    rsets = ("train.local_steps=3", "train.replicas=2", "train.steps=12", "scheduler.kwargs.T_max=12",
             "optimizer.name=AdamW", "optimizer.kwargs={lr: 0.001}", "cluster.spare_workers=0",
             "checkpoint.every_steps=0", "eval.fn=null")
    r = run_up(tmp_path / "resnet", *rsets, "cluster.shards=2", "cluster.workers=2", config=resnet)
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary["params_sha256"] == reference(tmp_path, *rsets, config=resnet)["params_sha256"]


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(600)
def test_every_role_killed_mid_round_leaves_the_reference(tmp_path: Path) -> None:
    """K = 2, W = 2, 4 replicas of AdamW, a checkpoint every 3 rounds, a paced model so each round takes a while:
    SIGKILL a worker, shard 1, the leader, the checkpointer, the coordinator and redis-server, each mid-round. Each
    death costs at most the rounds since the last checkpoint (a shard's or the leader's) or the replica's round (a
    worker's); the result is bitwise the reference's, and the resumed rounds started from the checkpointed inner
    states."""
    sets = ("train.local_steps=5", "train.replicas=4", "train.steps=200", "scheduler.kwargs.T_max=200",
            "optimizer.name=AdamW", "optimizer.kwargs={lr: 0.002}", "checkpoint.every_steps=3",
            "cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1")
    want = reference(tmp_path, *sets)["params_sha256"]
    c = Cluster(tmp_path / "run", *sets, "cluster.shards=2", "cluster.workers=2", "cluster.spare_workers=1",
                "model.factory=tests.helpers.fixtures:paced_mlp", "model.kwargs={pace: 0.01}")
    try:
        for at, (role, ident) in ((4, ("worker", "w0")), (9, ("aggregator", "1")), (16, ("aggregator", "0")),
                                  (22, ("checkpointer", "0")), (26, ("coordinator", "0")), (30, ("redis", "0"))):
            c.wait_step(at, timeout=180)
            if role == "redis":
                import os
                import signal

                pid = redis_pid(c)
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                continue
            inc = c.signal(role, ident)
            if role != "coordinator":
                c.replaced(role, ident, inc, timeout=90)
    finally:
        rc = c.wait(timeout=400)
    assert rc == 0, c.output()
    s = c.summary
    assert s["steps"] == 40 and s["params_sha256"] == want, (s["params_sha256"], want)
    events = [json.loads(x) for x in (c.run_dir / "events.jsonl").read_text().splitlines()]
    restored = [e["step"] for e in events if e["kind"] == "checkpoint_restored"]
    assert restored and all(step % 3 == 0 and step > 0 for step in restored), restored


# ------------------------------------------------------------------------------ streaming (train.fragments > 1)

STREAM = ("train.local_steps=6", "train.replicas=4", "train.fragments=3", "train.steps=72",
          "scheduler.kwargs.T_max=72", "cluster.spare_workers=0", "checkpoint.every_steps=0")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_streaming_gives_the_reference_for_any_workers_and_shards(tmp_path: Path) -> None:
    """Streaming DiLoCo, 3 fragments of a 6-step round (a server step is a segment of 2 inner steps: 36 of them), 4
    replicas: W = 1, 3 at K = 1 and W = 2 at K = 2 give the reference's params_sha256, with segments computed ahead
    (by a worker parked while another finishes the step) and, after the first step, only the changed fragment sent
    down. A replica stays with the worker that holds it (it moves after a death: the faults test below, whose
    workers replay from snapshots). The result differs from whole rounds (F = 1)."""
    ref = reference(tmp_path, *STREAM)
    assert ref["steps"] == 36
    got = {}
    for k, w in ((1, 1), (1, 3), (2, 2)):
        r = run_up(tmp_path / f"k{k}w{w}", *STREAM, f"cluster.shards={k}", f"cluster.workers={w}")
        assert r.rc == 0, r.stderr[-3000:]
        got[(k, w)] = r.summary["params_sha256"]
        assert r.summary["steps"] == 36 and "round   36/36 (inner step 72/72)" in r.stdout, r.stdout[-500:]
        assert set(r.summary["dropped_messages"]) <= {"duplicate", "stale_step"}, r.summary
        if w > 1:  # a worker parked while another finishes the step computes its next segment ahead
            assert r.summary["segments_ahead"] > 0, r.summary
        if w == 1:  # each step's first lease carries only the fragment the last step changed
            assert r.summary["changes_sent"] >= 35, r.summary
    assert set(got.values()) == {ref["params_sha256"]}, got
    whole = tuple(s for s in STREAM if not s.startswith("train.fragments"))
    assert reference(tmp_path, *whole)["params_sha256"] != ref["params_sha256"]


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(600)
def test_streaming_survives_a_worker_and_the_leader_killed(tmp_path: Path) -> None:
    """Streaming, K = 1, W = 2 and a spare, a checkpoint every 4 segments, a paced model: SIGKILL a worker mid-run
    (its replicas go to others, who replay from the snapshots), then the leader (restored from a checkpoint, whose
    snapshots every worker replays from): bitwise the reference's."""
    sets = (*[s for s in STREAM if not s.startswith(("checkpoint", "cluster.spare"))], "checkpoint.every_steps=4",
            "cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1")
    want = reference(tmp_path, *sets)["params_sha256"]
    c = Cluster(tmp_path / "run", *sets, "cluster.workers=2", "cluster.spare_workers=1",
                "model.factory=tests.helpers.fixtures:paced_mlp", "model.kwargs={pace: 0.01}")
    try:
        for at, (role, ident) in ((5, ("worker", "w0")), (15, ("aggregator", "0"))):
            c.wait_step(at, timeout=180)
            inc = c.signal(role, ident)
            c.replaced(role, ident, inc, timeout=90)
    finally:
        rc = c.wait(timeout=400)
    assert rc == 0, c.output()
    assert c.summary["steps"] == 36 and c.summary["params_sha256"] == want, (c.summary["params_sha256"], want)
    events = [json.loads(x) for x in (c.run_dir / "events.jsonl").read_text().splitlines()]
    restored = [e["step"] for e in events if e["kind"] == "checkpoint_restored"]
    assert restored and all(step % 4 == 0 and step > 0 for step in restored), restored
    assert c.summary["inner_states_sent"] > 0, c.summary  # snapshots went to workers that replayed from them
