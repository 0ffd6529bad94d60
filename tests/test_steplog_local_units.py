"""The step log with local steps (train.local_steps), without processes: the replicas' states in an entry, through
the wire and back, and a replay of a few rounds through a real Trainer ending bitwise where the live leader ended —
its outer parameters and momentum, and every replica's inner state (docs/design/step-log.md, "Local steps")."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.steplog import replicas
from cmemi.services.aggregator.steplog.link import inputs_of, tensors_of
from cmemi.services.aggregator.steplog.shard import in_use
from cmemi.services.worker.compute.local import LocalRound
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model
from cmemi.shared.core import innerstate
from cmemi.shared.wire import protocol

from tests.conftest import DIGITS

SETS = ("train.local_steps=2", "train.replicas=2", "train.steps=8", "optimizer.name=AdamW",
        "optimizer.kwargs={lr: 0.001}", "eval.fn=null")


def config(tmp_path, *sets: str):
    return load_config(DIGITS, [f"run.dir={tmp_path}", *SETS, *sets])


def runner(cfg) -> MicrobatchRunner:
    return MicrobatchRunner(cfg, build_model(cfg), resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs),
                            resolve(cfg.train.loss, "train.loss"))


def same_state(a: dict | None, b: dict | None) -> bool:
    """Two replica states bitwise equal: the same metadata and the same tensors."""
    (ma, ta), (mb, tb) = innerstate.to_wire(a), innerstate.to_wire(b)
    return ma == mb and ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta)


def through_the_wire(fields: dict, tensors: dict[str, torch.Tensor]) -> protocol.Message:
    """An entry as the checkpointer gets it and a replay reads it back: header through msgpack, tensors as frames."""
    frames = protocol.encode("step_log", "run", {"step": 1, "term": 1, "skip": False, "loss": 0.0, **fields}, tensors)
    return protocol.decode(frames, "run")



def logged_rounds(cfg, live: Trainer, n: int, spool: Any = None) -> list[protocol.Message]:
    """`n` rounds of two replicas (real LocalRounds, each starting from the leader's parameters, as a lease's)
    applied by `live`; each round's entry as the checkpointer gets it (through the wire), its states in `spool` (a
    StateSpool) when one is given, each round's record in a segment of its own."""
    assert live.inner is not None
    worker = runner(cfg)
    local = LocalRound(cfg, worker)
    entries = []
    for rnd in range(n):
        with torch.no_grad():
            for name, p in worker.params.items():
                p.copy_(live.params[name])
        deltas = []
        for r in range(2):
            _, delta, _, state = local.run(rnd, r, innerstate.through_wire(live.inner.start(r)))
            live.inner.keep(r, innerstate.through_wire(state))
            deltas.append(delta)
        mean = {k: (deltas[0][k] + deltas[1][k]) / 2 for k in deltas[0]}
        header, states = replicas.states_of(live.inner, spool, live.step + 1)
        msg = through_the_wire({"replicas": header}, {**tensors_of(mean, None), **states})
        msg.header["step"] = live.step + 1
        entries.append(msg)
        live.apply(mean)
        if spool is not None:
            spool.close()
    return entries

def test_an_entry_carries_the_states_a_step_makes_current_and_a_replay_puts_them_back(tmp_path) -> None:
    cfg = config(tmp_path)
    live = Trainer(cfg)
    assert live.inner is not None
    _, _, _, s1 = LocalRound(cfg, runner(cfg)).run(0, 1, None)
    live.inner.keep(1, innerstate.through_wire(s1))  # replica 1's round was accepted; replica 0's not (yet)
    want = innerstate.through_wire(s1)  # (a copy: the frames below may share the live state's memory)
    header, tensors = replicas.states_of(live.inner)
    assert header is not None and [r for r, _ in header] == [1]
    assert tensors and all(n.startswith("i.1.") for n in tensors)
    msg = through_the_wire({"replicas": header}, tensors)
    again = Trainer(cfg)
    assert again.inner is not None
    replicas.restore(again.inner, msg.header["replicas"], msg.tensors)
    assert list(again.inner.next) == [1] and same_state(again.inner.next[1], want)
    for t in msg.tensors.values():  # the replay reuses its buffers for the next entry: the state kept is a copy
        t.zero_()
    assert same_state(again.inner.next[1], want)
    assert replicas.states_of(None) == (None, {})  # a synchronous run's entry carries none


def test_a_malformed_entry_is_an_error_that_names_it(tmp_path) -> None:
    cfg = config(tmp_path)
    inner = Trainer(cfg).inner
    assert inner is not None
    with pytest.raises(replicas.EntryError, match="without its replicas"):
        replicas.restore(inner, None, {})
    with pytest.raises(replicas.EntryError, match="logged as"):
        replicas.restore(inner, [[5, {}]], {})
    with pytest.raises(replicas.EntryError, match="replica 0"):
        replicas.restore(inner, [[0, {"x": 1}]], {})


def test_a_replay_of_logged_rounds_ends_bitwise_where_the_leader_ended(tmp_path) -> None:
    """Four rounds of two replicas (real LocalRounds, AdamW inside, the default Nesterov outer step): the live leader
    keeps each round's states and applies the mean change; a second Trainer, restored from nothing, replays only
    the entries (through the wire) and ends with the same parameters, outer momentum and replica states."""
    cfg = config(tmp_path)
    live, replayed = Trainer(cfg), Trainer(cfg)
    assert live.inner is not None and replayed.inner is not None
    entries = logged_rounds(cfg, live, 4)
    for msg in entries:
        replicas.restore(replayed.inner, msg.header["replicas"], msg.tensors)
        grads, buffer_sum = inputs_of(msg.tensors, msg.header["skip"])
        assert grads is not None and not any(n.startswith("i.") for n in grads)
        replayed.apply(grads, buffer_sum)
    assert replayed.step == live.step == 4 and replayed.params_sha256() == live.params_sha256()
    sd, want = replayed.optimizer.state_dict()["state"], live.optimizer.state_dict()["state"]
    assert all(torch.equal(sd[i]["momentum_buffer"], want[i]["momentum_buffer"]) for i in want)
    assert all(same_state(replayed.inner.current[r], live.inner.current[r]) for r in range(2))
    assert live.inner.current[0] is not None


def test_the_log_is_on_with_local_steps_at_any_k_and_off_where_asked(tmp_path) -> None:
    assert in_use(config(tmp_path), Trainer(config(tmp_path)))
    assert in_use(config(tmp_path, "train.fragments=2"), Trainer(config(tmp_path, "train.fragments=2")))
    two = config(tmp_path, "cluster.shards=2")
    assert in_use(two, Trainer(two, shard=0)) and in_use(two, Trainer(two, shard=1))
    off = config(tmp_path, "checkpoint.step_log=false")
    assert not in_use(off, Trainer(off))
    sync = load_config(DIGITS, [f"run.dir={tmp_path}", "cluster.shards=2"])
    assert in_use(sync, Trainer(sync, shard=1))


def test_an_entry_header_holds_every_replica_in_order(tmp_path) -> None:
    cfg = config(tmp_path)
    inner = Trainer(cfg).inner
    assert inner is not None
    _, _, _, s = LocalRound(cfg, runner(cfg)).run(0, 0, None)
    inner.keep(1, innerstate.through_wire(s))
    inner.keep(0, innerstate.through_wire(s))
    header, tensors = replicas.states_of(inner)
    assert header is not None and [r for r, _ in header] == [0, 1]
    assert msgpack.unpackb(msgpack.packb(header), strict_map_key=False) == header
    assert {n.split(".")[1] for n in tensors} == {"0", "1"}


def test_the_entry_size_script_counts_what_an_entry_carries(tmp_path) -> None:
    """scripts/steplog_entry_bytes.py (the sizes docs/design/step-log.md points to) counts a replica's state as the
    bytes a real round's state has in an entry."""
    from scripts.steplog_entry_bytes import state_bytes

    cfg = config(tmp_path)
    trainer = Trainer(cfg)
    assert trainer.inner is not None
    _, _, _, s = LocalRound(cfg, runner(cfg)).run(0, 0, None)
    trainer.inner.keep(0, innerstate.through_wire(s))
    trainer.inner.keep(1, innerstate.through_wire(s))
    _, tensors = replicas.states_of(trainer.inner)
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == 2 * state_bytes(trainer) > 0
