"""The replicas' inner states spread over the shards (issue 48, `train.inner_states: shards`; docs/design/local-steps.md):
replica r's state goes to shard r mod K with that shard's slice of Δ_r, is kept, checked, checkpointed, logged and
handed out there (services/aggregator/shard/inner.py), and the result is `cmemi reference`'s at K = 2, 3 and W = 1, 2, 3,
whole rounds and streaming, with sparse2's per-replica residual, and after a worker or a shard SIGKILLed mid-run.

Unit tests of the shard's store first (a real Trainer of shard 1, a real round's state), then real clusters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from cmemi.services.aggregator.common.replicas import InnerStates
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.shard.inner import ShardStates
from cmemi.services.aggregator.steplog.replicas import states_of
from cmemi.services.worker.compute.local import LocalRound
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model
from cmemi.shared.core import innerstate

from tests.conftest import run_up
from tests.helpers.chaos import Cluster
from tests.test_local_steps import LOCAL, STREAM, digits, reference
from tests.test_outer_codecs_cluster import CODEC


def test_a_replica_belongs_to_shard_r_mod_k_unless_the_leader_keeps_them_all() -> None:
    assert [innerstate.owner(r, 3, "shards") for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert {innerstate.owner(r, 3, "leader") for r in range(7)} == {0}
    assert {innerstate.owner(r, 1, "shards") for r in range(7)} == {0}  # K = 1: the leader, as before
    assert innerstate.owned(8, 1, 3, "shards") == [1, 4, 7]
    with pytest.raises(ConfigError, match="train.inner_states"):
        digits("train.local_steps=5", "train.inner_states=workers")


def runner_of(cfg: Any) -> MicrobatchRunner:
    return MicrobatchRunner(cfg, build_model(cfg), resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs),
                            resolve(cfg.train.loss, "train.loss"))


def _shard_one(*sets: str) -> tuple[Any, Trainer, list[tuple[bytes, str, dict[str, Any]]], ShardStates]:
    cfg = digits("train.local_steps=2", "train.replicas=4", "train.steps=20", "cluster.shards=2", *sets)
    trainer = Trainer(cfg, shard=1)
    sent: list[tuple[bytes, str, dict[str, Any]]] = []
    store = ShardStates(trainer, lambda i, mtype, *_e, **f: sent.append((i, mtype, f)) or 10, RunTotals(), False)
    return cfg, trainer, sent, store


def test_a_shard_keeps_checks_and_hands_out_only_its_replicas_states() -> None:
    """Shard 1 of K = 2 keeps replicas 1 and 3: a well-formed state of replica 1 is kept once its change is accepted,
    current once the step is applied, in its snapshot's section and its step log entry; a state of replica 0 (the
    leader's), a malformed one, or a round without its state is a `bad_inner` drop; a worker's pull naming a replica is
    answered once the shard holds the lease's version, and refused for a replica it does not keep."""
    cfg, trainer, sent, store = _shard_one()
    assert trainer.inner is not None and sorted(trainer.inner.owned) == [1, 3]
    runner = runner_of(cfg)
    _, _, _, state = LocalRound(cfg, runner).run(0, 1, None)
    meta, tensors = innerstate.to_wire(state)
    h = {"step": 0, "lo": 1, "inner": meta}
    grad = {"w": torch.zeros(1), **tensors}
    got, keep, bad = store.take(h, grad)
    assert bad is None and keep and grad == {"w": grad["w"]}  # the state is taken out; the change stays
    name = next(iter(tensors))
    nan = {**tensors, name: torch.full_like(tensors[name], float("nan"))}
    for hh, tt in (({**h, "lo": 0}, tensors), (h, nan), (h, {}), ({**h, "inner": None}, {}),
                   ({**h, "inner": {"x": 1}}, tensors)):
        assert store.take(hh, dict(tt))[2] == "bad_inner", (hh["lo"], hh["inner"] is None)
    assert store.take({**h, "lo": 0, "inner": None}, {}) == (None, False, None)  # the leader's replica: none here
    store.pull(b"w1", {"replica": 1, "version": 1, "past": False})  # not here yet: waits
    store.pull(b"w2", {"replica": 0, "version": 0, "past": False})  # (`past`: the schema's default)
    assert [(i, m) for i, m, _ in sent] == [(b"w2", "reject")]
    store.accepted(1, got, keep)
    assert states_of(trainer.inner)[0] == [[1, meta]]  # the step log entry's replicas: this shard's, made current
    trainer.inner.advance()
    trainer.step = 1
    assert list(trainer.inner.state_dict()) == [1]
    store.answer()
    assert sent[-1][0] == b"w1" and sent[-1][1] == "inner" and sent[-1][2]["replica"] == 1
    assert sent[-1][2]["round"] == 1 and sent[-1][2]["meta"] == meta
    store.answer()
    assert len(sent) == 2  # answered once


def test_a_merged_checkpoint_gives_each_server_its_own_replicas() -> None:
    """A checkpoint of another K (or of the leader's placement) holds every replica's state somewhere: each server
    loads its own of them, and fresh where none was kept."""
    store = InnerStates(4, [1, 3])
    store.load_state_dict({0: {"a": 0}, 1: {"a": 1}, 2: {"a": 2}})
    assert store.current == {1: {"a": 1}, 3: None}


def test_streaming_a_segment_that_ships_no_state_carries_none_to_its_shard() -> None:
    cfg, trainer, _, store = _shard_one("train.fragments=4", "train.local_steps=4", "train.steps=40")
    shipless = next(s for s in range(1, 20) if not store.take({"step": s, "lo": 1, "inner": None}, {})[1])
    assert store.take({"step": shipless, "lo": 1, "inner": {"x": 1}}, {})[2] == "bad_inner"


# ---------------------------------------------------------------------------------------------- clusters


def _same(tmp_path: Path, sets: tuple[str, ...], runs: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], dict]:
    tmp_path.mkdir(exist_ok=True)
    want = reference(tmp_path, *sets)["params_sha256"]
    got, summaries = {}, {}
    for k, w in runs:
        r = run_up(tmp_path / f"k{k}w{w}", *sets, f"cluster.shards={k}", f"cluster.workers={w}", timeout=400)
        assert r.rc == 0, r.stderr[-3000:]
        assert set(r.summary["dropped_messages"]) <= {"duplicate", "stale_step"}, r.summary
        got[(k, w)], summaries[(k, w)] = r.summary["params_sha256"], r.summary
    assert set(got.values()) == {want}, (got, want)
    return summaries


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_whole_rounds_with_states_on_the_shards_give_the_reference(tmp_path: Path) -> None:
    """12 rounds of 4 replicas: K = 2 at W = 1, 3 and K = 3 at W = 1, 2, 3 (replica r's state on shard r mod K), and
    the leader's placement at K = 3, W = 2: one params_sha256, the reference's."""
    _same(tmp_path, LOCAL, ((2, 1), (2, 3), (3, 1), (3, 2), (3, 3)))
    _same(tmp_path / "leader", (*LOCAL, "train.inner_states=leader"), ((3, 2),))


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_streaming_with_states_on_the_shards_gives_the_reference(tmp_path: Path) -> None:
    """Streaming, 3 fragments of a 6-step round, 4 replicas: K = 2 at W = 1, 3 and K = 3 at W = 1, 2, 3; and sparse2
    (its per-replica residual in the state that goes to shard r mod K) at K = 3, W = 2."""
    _same(tmp_path, STREAM, ((2, 1), (2, 3), (3, 1), (3, 2), (3, 3)))
    _same(tmp_path / "sparse2", (*STREAM, "compression.codec=sparse2", *CODEC), ((3, 2),))


def _killed(tmp_path: Path, base: tuple[str, ...], kills: list[tuple[int, str, str]], shards: int) -> dict:
    """A paced K = `shards`, W = 2 run with a spare, each (step, role, id) of `kills` SIGKILLed once that step is
    reached (and waited for until replaced): bitwise the reference's."""
    sets = (*[s for s in base if not s.startswith(("checkpoint", "cluster.spare", "eval"))], "checkpoint.every_steps=4",
            "cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1")
    want = reference(tmp_path, *sets)
    c = Cluster(tmp_path / "run", *sets, f"cluster.shards={shards}", "cluster.workers=2", "cluster.spare_workers=1",
                "model.factory=tests.helpers.fixtures:paced_mlp", "model.kwargs={pace: 0.01}")
    try:
        for at, role, ident in kills:
            c.wait_step(at, timeout=300)
            c.replaced(role, ident, c.signal(role, ident), timeout=120)
    finally:
        rc = c.wait(timeout=600)
    assert rc == 0, c.output()
    assert c.summary["steps"] == want["steps"]
    assert c.summary["params_sha256"] == want["params_sha256"], (c.summary["params_sha256"], want["params_sha256"])
    return c.summary


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fragments", [1, 3])
def test_a_worker_killed_with_states_on_the_shards_leaves_the_reference(tmp_path: Path, fragments: int) -> None:
    """K = 3, W = 2 and a spare, sparse2: SIGKILL a worker mid-run; its replicas are taken by others, whose states
    (residual included; streaming: the snapshot, replayed from) come from the shard that keeps each: bitwise."""
    base = STREAM if fragments > 1 else (*LOCAL, "train.steps=200", "scheduler.kwargs.T_max=200")
    s = _killed(tmp_path, (*base, "compression.codec=sparse2", *CODEC), [(5, "worker", "w0")], 3)
    assert s["inner_states_sent"] > 0, s  # its replicas moved with their states, from the servers that keep them


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fragments", [1, 3])
def test_a_shard_killed_with_states_on_the_shards_leaves_the_reference(tmp_path: Path, fragments: int) -> None:
    """K = 3, W = 2 and a spare: SIGKILL shard 1 (which keeps replica 1's state) mid-run; it restores its replicas'
    states from its checkpoint's `inner` section and its step log entries. Then both workers are SIGKILLed, so that
    every replica's next round (or segment) starts from a state a server hands out, shard 1's restored one included:
    bitwise the reference's, no round trained twice."""
    base = STREAM if fragments > 1 else (*LOCAL, "train.steps=200", "scheduler.kwargs.T_max=200")
    s = _killed(tmp_path, (*base, "train.log_every=1"), [(6, "aggregator", "1"), (9, "worker", "w0"),
                                                         (11, "worker", "w1")], 3)
    assert s["inner_states_sent"] > 0 and any(x.get("inner_states_sent") for x in s["shards"]), s
    metrics = [json.loads(x) for x in (Path(tmp_path / "run") / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [e["step"] for e in metrics if "loss" in e and "eval" not in e]
    assert len(steps) == len(set(steps)) and s["steps"] == max(steps), sorted(steps)[-10:]
