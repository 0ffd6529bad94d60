"""`train.state_every` (D, issue 48: "states snapshotted rarely"): a replica's state goes up to its server after
rounds t with (t + r) mod D = 0 (and round 0), not every round; docs/design/local-steps.md, "Snapshotted every D
rounds". Units: the config field, the due rule that the worker sends by and every server takes by, the servers'
history of versions a replay needs (services/aggregator/common/history.py) and the worker's replay of rounds s … t − 1
(`LocalRound.catch_up`), bitwise equal to computing them in one go.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cmemi.services.worker.compute.local import LocalRound
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model
from cmemi.shared.core import fragments, innerstate
from cmemi.shared.core.grid import Partition
from cmemi.shared.core.history import Versions
from cmemi.shared.wire import limits

from tests.conftest import DIGITS, run_up
from tests.helpers import references
from tests.helpers.chaos import Cluster
from tests.test_steplog_local import ROUNDS, killed_leader_runs_to_the_reference

WHOLE = ("train.local_steps=5", "train.replicas=4", "train.steps=60")
LOCAL = ("train.local_steps=5", "train.replicas=4", "train.steps=60", "scheduler.kwargs.T_max=60",
         "cluster.spare_workers=0", "checkpoint.every_steps=0", "eval.every_steps=4")  # (test_local_steps.py's)


def test_state_every_defaults_to_every_round_and_refuses_what_it_cannot_keep_exact() -> None:
    assert load_config(DIGITS, list(WHOLE)).train.state_every == 1
    assert load_config(DIGITS, [*WHOLE, "train.state_every=4"]).train.state_every == 4  # whole rounds, one server
    assert load_config(DIGITS, [*WHOLE, "train.state_every=4", "cluster.shards=2"]).cluster.shards == 2  # and K > 1
    for sets, why in [(("train.state_every=0",), "must be >= 1"),
                      (("train.steps=300", "train.state_every=4"), "train.local_steps is 0"),
                      (("train.local_steps=6", "train.fragments=3", "train.steps=60", "train.state_every=4"),
                       "streaming sends")]:
        with pytest.raises(ConfigError, match=f"config field 'train.state_every' = .*{why}.*; (use|set)") as err:
            load_config(DIGITS, ["train.steps=300", *sets] if "train.steps=60" not in sets else list(sets))
        assert "\n" not in str(err.value)  # one line, naming the field and the fix


def test_the_due_rule_ships_round_zero_then_every_d_rounds_staggered_by_replica() -> None:
    D, R, T = 4, 4, 16
    for r in range(R):
        shipped = [t for t in range(T) if innerstate.due(t, r, D)]
        assert shipped[0] == 0 and all((t + r) % D == 0 for t in shipped[1:])
        assert all(b - a <= D for a, b in zip(shipped, shipped[1:], strict=False))  # never more than D rounds apart
    # staggered: each round after the first ships about R / D states, not all R every D rounds
    assert all(sum(innerstate.due(t, r, D) for r in range(R)) == R // D for t in range(1, T))
    # D = 1 is the rule before issue 48: every round ships every replica's state
    assert all(innerstate.due(t, r, 1) for t in range(T) for r in range(R))


def test_a_snapshot_is_at_most_d_minus_one_rounds_behind_and_current_at_d_equal_one() -> None:
    D = 4
    for r in range(5):
        for t in range(20):
            s = innerstate.snapshot_start(t, r, D)
            assert 0 <= t - s <= D - 1, (r, t, s)
            assert s == 0 or innerstate.due(s - 1, r, D)  # the round before it shipped the state
            assert not any(innerstate.due(u, r, D) for u in range(s, t))  # and none since
        assert [innerstate.snapshot_start(t, r, 1) for t in range(6)] == list(range(6))


def test_streaming_keeps_its_own_rule() -> None:
    """The whole-rounds rule is not streaming's: a streaming run's snapshots stay `fragments.ships_state`'s."""
    assert [s for s in range(8) if fragments.ships_state(s, 3, 1)] == [0, 1, 4, 7]


# ---------------------------------------------------------------------------------------------- the history (unit)

def test_the_history_keeps_the_window_prunes_the_rest_and_refuses_a_version_outside_it_with_the_reason() -> None:
    D, R = 4, 4
    h = Versions(R, D)
    for v in range(10):
        h.keep(v, {"w": torch.full((3,), float(v))})
        assert min(h.kept) == h.oldest(v) and max(h.kept) == v and len(h.kept) <= D
    assert sorted(h.kept) == [6, 7, 8, 9]  # at round 9 the replicas' snapshots start rounds 9, 8, 7, 6: D versions
    assert all(h.oldest(9) <= innerstate.snapshot_start(9, r, D) for r in range(R))
    old, why = h.get(6)
    assert why is None and old is not None and torch.equal(old["w"], torch.full((3,), 6.0))
    assert h.nbytes() == 4 * 3 * 4
    gone, why = h.get(5)
    assert gone is None and why is not None and "version 5 is not in this server's history (versions held: 6..9" in why
    live = torch.zeros(2)
    h.keep(10, {"w": live})
    live.add_(1)  # the server steps its pieces in place: the history holds a copy
    assert torch.equal(h.get(10)[0]["w"], torch.zeros(2))
    again = Versions(R, D)
    again.load_state_dict(h.state_dict())  # what a restored server answers
    assert sorted(again.kept) == sorted(h.kept) and torch.equal(again.get(8)[0]["w"], h.get(8)[0]["w"])
    once = Versions(R, 1)  # D = 1: nothing kept, a snapshot always starts the current round
    once.keep(0, {"w": live})
    assert not once.kept and once.nbytes() == 0


def test_the_message_bound_counts_the_history_and_is_unchanged_at_d_equal_one() -> None:
    cfg = load_config(DIGITS, list(WHOLE))
    before = limits.logical_bytes(cfg)
    cfg.train.state_every = 4
    assert limits.logical_bytes(cfg) >= before + 3 * limits.model_bytes(cfg)


# ---------------------------------------------------------------------------------------------- a replay (unit)

def _runner(cfg) -> MicrobatchRunner:
    return MicrobatchRunner(cfg, build_model(cfg), resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs),
                            resolve(cfg.train.loss, "train.loss"))


def _flat(state) -> tuple:
    meta, tensors = innerstate.to_wire(state)
    return meta, {n: t.clone() for n, t in tensors.items()}


@pytest.mark.parametrize("codec", ["none", "sparse2"])
def test_a_replay_of_rounds_s_to_t_minus_one_is_bitwise_the_rounds_computed_in_one_go(codec: str) -> None:
    """Replica r's rounds 0 … 4 computed in one go as a cluster would (each from its θ_u, an outer step between
    them), then its round 4 on another worker from the snapshot that starts round 1: rounds 1 … 3 replayed from the
    kept versions, then round 4, give the same change and state, bit for bit (sparse2: its residual too). From the
    lease's version alone (what a server without history could give) the result differs."""
    sets = [*WHOLE, "train.local_steps=2", "train.replicas=2", "model.kwargs.dropout=0.0"]
    if codec == "sparse2":
        sets += ["compression.codec=sparse2", "compression.min_compress_numel=256", "compression.sparse_chunk=256"]
    cfg = load_config(DIGITS, sets)
    ra, rb = _runner(cfg), _runner(cfg)
    a, b = LocalRound(cfg, ra, Partition(ra.params)), LocalRound(cfg, rb, Partition(rb.params))
    views = Partition(ra.params).views
    states: dict[int, list] = {0: [None], 1: [None]}
    versions, results = [], []
    for u in range(5):
        versions.append({n: p.detach().clone() for n, p in views(ra.params).items()})  # by piece, as servers keep them
        deltas = []
        for r in (0, 1):
            _, delta, _, new = a.lease(u, r, u, states[r][-1])
            states[r].append(innerstate.through_wire(new))
            deltas.append(delta)
            if r == 1:
                results.append((delta, _flat(new)))
        with torch.no_grad():  # an outer step, so each round starts from other parameters
            for n, v in views(ra.params).items():
                v.sub_(0.5 * (deltas[0][n] + deltas[1][n]))
    r, s, t = 1, 1, 4
    with torch.no_grad():
        for n, p in views(rb.params).items():
            p.copy_(versions[t][n])
    state = b.catch_up(s, t, r, states[r][s], lambda u: versions[u])
    assert all(torch.equal(p, versions[t][n]) for n, p in views(rb.params).items())  # θ_t again, for the lease
    _, delta, _, new = b.lease(t, r, t, state)
    want_delta, (want_meta, want_tensors) = results[t]
    meta, tensors = _flat(new)
    assert all(torch.equal(delta[n], want_delta[n]) for n in want_delta) and delta.keys() == want_delta.keys()
    assert meta == want_meta and all(torch.equal(tensors[n], want_tensors[n]) for n in want_tensors)
    if codec == "sparse2":
        assert "residual" in new and any(float(x.abs().max()) > 0 for x in new["residual"].values())
    _, leased, _, _ = b.lease(t, r, s, states[r][s], lambda u: versions[u])  # the worker's one call: the same
    assert all(torch.equal(leased[n], want_delta[n]) for n in want_delta)
    wrong = b.catch_up(s, t, r, states[r][s], lambda u: versions[t])  # no history: every round from θ_t
    _, bad, _, _ = b.lease(t, r, t, wrong)
    assert any(not torch.equal(bad[n], want_delta[n]) for n in want_delta)


# ---------------------------------------------------------------------------------------------- clusters

def events(run_dir: Path, kind: str) -> list[dict]:
    """The run's events of `kind` (events.jsonl)."""
    return [e for e in (json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip())
            if e["kind"] == kind]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_states_every_four_rounds_give_the_reference_at_any_worker_count(tmp_path: Path) -> None:
    """D = 4, whole rounds, K = 1, W = 2 and 3 (3 workers for 4 replicas: replicas move between workers, so new holders
    replay from snapshots): the params_sha256 of `cmemi reference` (which D does not change), and fewer states up."""
    want = references.reference(tmp_path, *LOCAL)["params_sha256"]
    replayed = 0
    for w in (2, 3):
        r = run_up(tmp_path / f"w{w}", *LOCAL, "train.state_every=4", f"cluster.workers={w}")
        assert r.rc == 0, r.stderr[-3000:]
        assert r.summary["steps"] == 12 and r.summary["params_sha256"] == want, (w, r.summary)
        assert set(r.summary["dropped_messages"]) <= {"duplicate", "stale_step"}, r.summary
        replays = events(tmp_path / f"w{w}", "replay")
        assert all(1 <= e["rounds"] <= 3 for e in replays), replays  # at most D − 1 rounds computed again
        assert r.summary["inner_rounds_replayed"] == sum(e["rounds"] for e in replays)
        replayed += len(replays)
    assert replayed, "no replica moved: the replay was not exercised"


PACED = ("cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1", "model.factory=tests.helpers.fixtures:paced_mlp",
         "model.kwargs={pace: 0.01}")
SPARSE = ("compression.codec=sparse2", "compression.min_compress_numel=256", "compression.sparse_chunk=256",
          "compression.downlink=int8")
INT4 = ("compression.codec=int4", "compression.min_compress_numel=256", "compression.lowbit_chunk=100",
        "compression.downlink=int4")  # bench/cluster.py's cmemi_local_rare: int4 both ways


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(900)
@pytest.mark.parametrize("codec", ["none", "sparse2", "int4"])
def test_a_worker_killed_costs_at_most_d_rounds_replayed_bitwise(tmp_path: Path, codec: str) -> None:
    """D = 4, whole rounds, W = 2 and a spare, a paced model, K = 1 (K = 2: tests/test_state_every_shards.py):
    SIGKILL a worker mid-run; its replicas go to the others and the spare with their snapshots and the versions since, and each is
    replayed (at most D − 1 rounds) and computed on: bitwise `cmemi reference` (with sparse2 and an int8 downlink: the
    residual replayed, each round from its mirror m_u; with int4 both ways, the same from int4 mirrors;
    params_sha256 and mirror_sha256)."""
    sets = (*[s for s in LOCAL if not s.startswith(("checkpoint", "cluster.spare", "eval", "train.steps",
                                                     "scheduler"))],
            "train.steps=200", "scheduler.kwargs.T_max=200", "checkpoint.every_steps=4", *PACED,
            *{"sparse2": SPARSE, "int4": INT4}.get(codec, ()))
    a_worker_killed_replays_bitwise(tmp_path, (*sets, "train.state_every=4"), at=6, timeout=600)


def a_worker_killed_replays_bitwise(tmp_path: Path, sets: tuple[str, ...], at: int, timeout: float) -> list[dict]:
    """`sets` with W = 2 and a spare: SIGKILL worker w0 once the run reaches step `at`; the run ends bitwise
    `cmemi reference` (params_sha256 and mirror_sha256), every replay is at most D − 1 rounds (D = 4), some replay
    comes at or after the kill (its replicas), and summary.json counts the replayed rounds. Returns the replays."""
    want = references.reference(tmp_path, *sets)
    c = Cluster(tmp_path / "run", *sets, "cluster.workers=2", "cluster.spare_workers=1")
    try:
        killed = c.wait_step(at, timeout=300)
        inc = c.signal("worker", "w0")
        c.replaced("worker", "w0", inc, timeout=120)
    finally:
        rc = c.wait(timeout=timeout)
    assert rc == 0, c.output()
    s = c.summary
    assert s["steps"] == want["steps"] and s["params_sha256"] == want["params_sha256"], (s, want["params_sha256"])
    assert s.get("mirror_sha256") == want.get("mirror_sha256"), (s, want)
    replays = events(c.run_dir, "replay")
    assert replays and all(1 <= e["rounds"] <= 3 for e in replays), replays  # a death costs at most D − 1 + 1 rounds
    # after the kill: the dead worker's replicas were replayed (from the step it was sent at: its first replay can land
    # in that very round, which a fixed `> 6` refused 1 run in 4)
    assert any(e["round"] >= killed for e in replays), replays
    assert s["inner_rounds_replayed"] == sum(e["rounds"] for e in replays), (s, replays)
    return replays


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(600)
def test_the_leader_killed_restores_the_history_from_its_checkpoint_and_step_log(tmp_path: Path) -> None:
    """D = 4, the step log on, a checkpoint every 12 rounds: the leader SIGKILLed twice after the first checkpoint;
    each new term restores the checkpoint (its snapshots and the history of versions since the oldest one) and replays
    the log to the step, re-keeping each version: bitwise `cmemi reference`, no round trained twice (the step log
    tests' checks, tests/test_steplog_local.py)."""
    replays = killed_leader_runs_to_the_reference(tmp_path, (*ROUNDS, "train.state_every=4"), [(14, 20), (26, 32)],
                                                  checkpoint=12)
    assert all(e["checkpoint"] in (12, 24, 36) and e["checkpoint"] < e["step"] for e in replays), replays
