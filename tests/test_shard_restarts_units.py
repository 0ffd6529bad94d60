"""A shard restarted within a term (issue 47): the leader's decision (services/aggregator/leader/roster.py `Restarts`), the
roster that acts on it (roster.py), and the worker's reading of where each shard is now
(services/worker/links/shard_addrs.py). In-process: real rosters of a real partition with a recording outbox (as
test_roster_units.py), a real Redis for the addresses; the whole path is test_steplog_sharded.py's."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import redis
from cmemi.services.aggregator.leader.roster import CATCH_UP_S, Rejoin, Restarts, ShardRoster
from cmemi.services.worker.lease import LeaseWork
from cmemi.services.worker.links.shard_addrs import ShardAddrs
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect
from cmemi.shared.core.grid import Partition
from cmemi.shared.runtime.exits import Exit

from tests.test_roster_units import TERM, Sent, context, model


def test_the_decision_takes_a_new_incarnation_at_the_leaders_step_and_rolls_back_only_what_the_log_cannot_bring() -> None:
    r = Restarts()
    assert r.decide(1, None, 5, its_step=40, step=40, now=0.0) is Rejoin.ACCEPT  # the term's start
    assert r.decide(1, None, 5, its_step=20, step=40, now=0.0) is Rejoin.ROLL_BACK  # (as before issue 47)
    assert r.decide(1, 5, 4, its_step=40, step=40, now=0.0) is Rejoin.STALE  # an older incarnation: fenced
    assert r.decide(1, 5, 7, its_step=40, step=40, now=0.0) is Rejoin.ACCEPT  # restarted, replayed to the step
    assert r.decide(1, 5, 7, its_step=40, step=40, now=0.0, can_replay=False) is Rejoin.ROLL_BACK  # no log
    assert r.decide(1, 5, 7, its_step=41, step=40, now=0.0) is Rejoin.ROLL_BACK  # ahead: not this term's state


def test_a_shard_behind_is_told_again_while_it_moves_and_rolled_back_once_it_stops_moving() -> None:
    r = Restarts()
    assert r.decide(1, 5, 7, its_step=20, step=40, now=0.0) is Rejoin.BEHIND
    assert r.decide(1, 5, 7, its_step=20, step=40, now=CATCH_UP_S / 2) is Rejoin.BEHIND  # said again: not moved yet
    assert r.decide(1, 5, 7, its_step=39, step=40, now=CATCH_UP_S * 0.9) is Rejoin.BEHIND  # moved: its clock restarts
    assert r.decide(1, 5, 7, its_step=39, step=40, now=CATCH_UP_S * 1.5) is Rejoin.BEHIND
    assert r.decide(1, 5, 7, its_step=39, step=40, now=CATCH_UP_S * 2) is Rejoin.ROLL_BACK  # the log lacks step 40
    assert r.decide(1, 5, 8, its_step=39, step=40, now=CATCH_UP_S * 2) is Rejoin.BEHIND  # another incarnation: anew
    assert r.decide(1, 5, 8, its_step=40, step=40, now=CATCH_UP_S * 2) is Rejoin.ACCEPT and not r.catching


def roster(replays: bool) -> tuple[ShardRoster, Sent, list[tuple[str, str]]]:
    sent, drops = Sent(), []
    r = ShardRoster(context(), Partition(model(), shards=3), TERM, sent, lambda reason, d: drops.append((reason, d)),
                    lambda: {"lease_key": b"k", "fp": {"sha256": "x"}}, replays=replays)
    return r, sent, drops


def join(r: ShardRoster, k: int, inc: int, its_step: int, step: int, ident: bytes | None = None) -> bool:
    return r.join(ident or f"s{k}/{inc}".encode(), {"shard": k, "term": TERM, "inc": inc, "step": its_step,
                                                    "addr": f"tcp://s{k}/{inc}"}, step=step)


def test_the_roster_takes_a_restarted_shard_in_the_term_in_its_dead_incarnations_place() -> None:
    r, sent, drops = roster(replays=True)
    assert not join(r, 1, inc=1, its_step=0, step=0) and join(r, 2, inc=2, its_step=0, step=0) and r.complete
    r.fence("w0", 3)
    n = len(sent.log)
    assert not join(r, 1, inc=9, its_step=35, step=40)  # restarted: told the leader's step
    assert sent.log[n:] == [(b"s1/9", "shard_behind", {"term": TERM, "step": 40})] and r.shards[1].inc == 1
    assert not join(r, 1, inc=9, its_step=40, step=40)  # caught up: in shard 1's place, told the fences
    assert [(i, m) for i, m, _ in sent.log[n + 1:]] == [(b"s1/9", "shard_welcome"), (b"s1/9", "shard_fence")]
    assert r.complete and r.addrs() == ["tcp://s1/9", "tcp://s2/2"] and r.ctx.emitted == ["shard_restarted"]
    # the dead incarnation, back from SIGSTOP: nothing it says counts, and a join of it is refused
    ready = {"shard": 1, "inc": 1, "term": TERM, "step": 40, "partials": [1.0], "overflow": False}
    assert not r.ready(b"s1/1", ready, step=40) and drops[-1][0] == "unknown_shard"
    assert r.others_ready(40) is None  # (its share does not count for the new one)
    assert not join(r, 1, inc=1, its_step=40, step=40) and drops[-1][0] == "stale_shard"
    assert sent.log[-1][:2] == (b"s1/1", "reject") and not sent.log[-1][2]["fatal"]
    assert r.ready(b"s1/9", {**ready, "inc": 9}, step=40)


def test_a_restarted_shard_lacks_the_whole_step_leased_again_at_once() -> None:
    from cmemi.services.aggregator.common.collector import StepCollector

    r, _, _ = roster(replays=True)
    join(r, 1, inc=1, its_step=0, step=0), join(r, 2, inc=2, its_step=0, step=0)
    collector = StepCollector(step=0, microbatches=4, leased=False)
    for m in range(4):
        collector.offer((m, m + 1), {}, [0.5], None)
    assert collector.complete
    h = {"shard": 2, "inc": 2, "term": TERM, "step": 0, "have": [0, 1]}
    assert not r.have(b"s2/2", h, collector, grace=60.0)  # a live shard's gap: after the grace
    join(r, 1, inc=9, its_step=0, step=0)
    h = {"shard": 1, "inc": 9, "term": TERM, "step": 0, "have": [0]}
    assert r.have(b"s1/9", h, collector, grace=60.0) and list(collector.pending)[:3] == [(1, 2), (2, 3), (3, 4)]
    assert [collector.lease("w", 1, 0.0, 10) for _ in range(3)] == [(1, 2), (2, 3), (3, 4)]
    # those leases say where shard 1 is now (`news`): the worker relinks before pushing, so its next report is not
    # answered at once again (a repeat every 0.5 s recomputed a long step's leases still on their way to it)
    h = {**h, "have": [0, 1]}
    assert not r.have(b"s1/9", h, collector, grace=60.0) and not collector.pending
    # what it still lacks a grace later goes back as for any shard (a worker that died between its sends)
    assert r.have(b"s1/9", h, collector, grace=0.0) and list(collector.pending) == [(2, 3), (3, 4)]
    later = StepCollector(step=1, microbatches=4, leased=False)  # its next step: a gap waits the grace again
    later.offer((0, 1), {}, [0.5], None)
    h = {"shard": 1, "inc": 9, "term": TERM, "step": 1, "have": []}
    assert not r.have(b"s1/9", h, later, grace=60.0) and list(later.pending) == [(1, 2), (2, 3), (3, 4)]


def test_without_the_step_log_a_restarted_shard_rolls_the_cluster_back_as_before() -> None:
    r, _, _ = roster(replays=False)
    join(r, 1, inc=1, its_step=0, step=0)
    with pytest.raises(SystemExit) as exc:
        join(r, 1, inc=2, its_step=5, step=40)
    assert exc.value.code == Exit.REJOIN and r.ctx.emitted == ["shard_restarted"]


def test_a_restarted_shard_that_cannot_catch_up_rolls_the_cluster_back(monkeypatch: pytest.MonkeyPatch) -> None:
    r, sent, _ = roster(replays=True)
    join(r, 1, inc=1, its_step=0, step=0)
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    assert not join(r, 1, inc=2, its_step=20, step=40) and sent.log[-1][1] == "shard_behind"
    now[0] += CATCH_UP_S + 0.1  # joined again, not moved: the log lacks its entries (a double fault)
    with pytest.raises(SystemExit) as exc:
        join(r, 1, inc=2, its_step=20, step=40)
    assert exc.value.code == Exit.REJOIN


def test_the_worker_reads_where_each_shard_is_now(redis_server) -> None:
    client, keys = connect(redis_server.url), Keys("restarts")
    client.hset(keys.member("aggregator", "1"), mapping={"addr": "tcp://old", "state": "running"})
    addrs = ShardAddrs(client, keys, shards=3)
    try:
        deadline = time.monotonic() + 10
        while addrs.newest(1, "tcp://told") != "tcp://old" and time.monotonic() < deadline:
            addrs.poke()
        assert addrs.newest(1, "tcp://told") == "tcp://old" and addrs.newest(2, "tcp://two") == "tcp://two"
        assert addrs.moved({1: "tcp://old", 2: "tcp://two"}) is None
        client.hset(keys.member("aggregator", "1"), mapping={"addr": "tcp://new", "state": "running"})
        moved = None
        while moved is None and time.monotonic() < deadline:
            addrs.poke()
            moved = addrs.moved({1: "tcp://old", 2: "tcp://two"})
        assert moved == (1, "tcp://new")
    finally:
        addrs.stop()


@pytest.mark.parametrize("sets,in_term", [
    ((), True),  # the log on, no state outside the shard: its replay alone makes it its dead incarnation
    (("checkpoint.step_log=false",), False),  # nothing to replay: a new term from the checkpoint, as before the log
    (("cluster.pipeline_stages=2",), False),  # pipelined shards keep no log
    (("compression.codec=topk",), False),  # the workers' residuals: rewound at a new term only
    (("train.local_steps=5", "train.replicas=2"), False),  # the replicas' states: likewise
])
def test_a_restarted_shard_is_taken_in_the_term_only_where_its_replay_alone_brings_back_what_it_held(
        tmp_path, sets: tuple[str, ...], in_term: bool) -> None:
    """services/aggregator/steplog/shard.py `replays_in_term`, read off what holds the state (the trainer's log and
    local steps, the codec's residuals), as the leader passes it to its roster (`replays`)."""
    from cmemi.services.aggregator.common.trainer import Trainer
    from cmemi.services.aggregator.steplog.shard import replays_in_term
    from cmemi.shared.compression.registry import make_codec
    from cmemi.shared.config.loading import load_config

    from tests.conftest import DIGITS

    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", "cluster.shards=2", *sets])
    assert replays_in_term(cfg, Trainer(cfg), make_codec(cfg.compression)) is in_term


def test_a_lease_after_a_shard_was_taken_in_says_where_every_shard_is_once_per_worker() -> None:
    r, _, _ = roster(replays=True)
    join(r, 1, inc=1, its_step=0, step=0), join(r, 2, inc=2, its_step=0, step=0)
    assert r.news(b"w0") is None  # no restart: a lease carries no addresses
    join(r, 1, inc=9, its_step=0, step=0)  # shard 1 restarted, taken in
    assert r.news(b"w0") == [[1, 9, "tcp://s1/9"], [2, 2, "tcp://s2/2"]] and r.news(b"w0") is None
    assert r.news(b"w1") == [[1, 9, "tcp://s1/9"], [2, 2, "tcp://s2/2"]]  # each worker connection once
    join(r, 2, inc=12, its_step=0, step=0)
    assert r.news(b"w0") == [[1, 9, "tcp://s1/9"], [2, 12, "tcp://s2/12"]]


def test_a_leased_address_moves_the_link_before_the_record_is_read_and_an_older_reading_never_moves_it_back(
        redis_server) -> None:
    client, keys = connect(redis_server.url), Keys("leased")
    client.hset(keys.member("aggregator", "1"), mapping={"addr": "tcp://old:1", "state": "running", "incarnation": "1"})
    addrs = ShardAddrs(client, keys, shards=3)
    try:
        deadline = time.monotonic() + 10
        while addrs.newest(1, "tcp://told:1") != "tcp://old:1" and time.monotonic() < deadline:
            addrs.poke()
        linked = {1: "tcp://old:1", 2: "tcp://two:2"}
        assert addrs.moved(linked) is None
        addrs.told([[1, 9, "tcp://new:3"], [2, 2, "tcp://two:2"]])  # the lease, before the record names it
        assert addrs.moved(linked) == (1, "tcp://new:3") and addrs.dropped == 0
        linked[1] = "tcp://new:3"
        # a reading of the dead incarnation's record taken after the lease never moves the link back: shard 2's record
        # changes with it, so the reading that moves shard 2 read shard 1's old record too (moved() looks at 1 first)
        client.hset(keys.member("aggregator", "1"), mapping={"addr": "tcp://older:5", "incarnation": "1"})
        client.hset(keys.member("aggregator", "2"), mapping={"addr": "tcp://two:4", "state": "running",
                                                             "incarnation": "3"})
        moved = None
        while moved is None and time.monotonic() < deadline:
            addrs.poke()
            moved = addrs.moved(linked)
        assert moved == (2, "tcp://two:4") and addrs.newest(1, "tcp://told:1") == "tcp://new:3"
    finally:
        addrs.stop()


@pytest.mark.parametrize("entries", [
    "tcp://h:1", [[1, 9]], [[1, 9, "nonsense"]], [[7, 9, "tcp://h:1"]], [[1, True, "tcp://h:1"]],
    [[1, -1, "tcp://h:1"]], [[1, 9, "tcp://h:1 ; rm"]], [[1, 9, b"tcp://h:1"]], [None], [[1.0, 9, "tcp://h:1"]],
])
def test_a_malformed_address_in_a_lease_is_dropped_and_counted_never_fails_the_worker(entries) -> None:
    addrs = ShardAddrs(redis.Redis(port=1, socket_connect_timeout=0.1), Keys("bad"), shards=3)  # Redis unreachable
    logged: list[tuple[str, dict]] = []
    work = LeaseWork.__new__(LeaseWork)  # its `told` alone: what a lease's `shards` goes through
    work.shard_links = SimpleNamespace(addrs=addrs)
    work.log = SimpleNamespace(warning=lambda event, **kw: logged.append((event, kw)))
    try:
        work.told(entries)
        assert addrs.dropped >= 1 and not addrs.seen and addrs.moved({1: "tcp://a:1", 2: "tcp://b:2"}) is None
        assert logged and logged[0][0] == "message dropped" and logged[0][1]["reason"] == "bad_shard_addr"
        work.told([[1, 9, "tcp://10.0.0.5:4100|ipc:///tmp/x.sock|abc"], [2, 2, "tcp://b:2"]])  # a good one still counts
        assert addrs.moved({1: "tcp://a:1", 2: "tcp://b:2"}) == (1, "tcp://10.0.0.5:4100|ipc:///tmp/x.sock|abc")
    finally:
        addrs.stop()
