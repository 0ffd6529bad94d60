"""The step log at K > 1 at the checkpointer, without processes (services/checkpointer/steplog_replies.py): the
leader's ack waits for every shard's entry of its step, a replay ends at the leader's log end with what lies past
it dropped, and a shard's replay applies its own slice with the leader's decision."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cmemi.services.checkpointer import spool
from cmemi.services.checkpointer.steplog import StepLog
from cmemi.services.checkpointer.steplog_replies import LogReplies


class Replies:
    """LogReplies with every reply recorded as (identity, type, fields)."""

    def __init__(self, tmp_path: Path, shards: int) -> None:
        self.log = StepLog(0, 1 << 20, lambda of, m: spool.Spool(tmp_path, of["step"], of["shard"], m,
                                                                 lambda exc, attempt: None))
        self.sent: list[tuple[bytes, str, dict[str, Any], dict | None]] = []
        self.events: list[tuple[str, dict]] = []
        self.r = LogReplies(self.log, lambda i, t, f, tensors=None: self.sent.append((i, t, f, tensors)),
                            lambda kind, **f: self.events.append((kind, f)), shards)

    def entry(self, shard: int, step: int, skip: bool = False, partials: list[float] | None = None) -> None:
        h = {"step": step, "term": 1, "shard": shard, "skip": skip, "loss": float(step), "partials": partials,
             "evals": None}
        self.r.handle(f"s{shard}".encode(), SimpleNamespace(type="step_log", header=h,
                                                            tensors={"g.w": torch.full((2,), float(10 * shard + step))}))

    def req(self, shard: int, after: int, term: int = 2) -> tuple[str, dict, dict | None]:
        self.r.handle(f"s{shard}".encode(), SimpleNamespace(type="log_req", tensors={},
                                                            header={"term": term, "after": after, "shard": shard}))
        _, mtype, fields, tensors = self.sent[-1]
        return mtype, fields, tensors

    def acks(self, shard: int) -> list[tuple[str, int]]:
        return [(t, f["step"]) for i, t, f, _ in self.sent if i == f"s{shard}".encode() and t in ("logged", "log_gap")]


def test_the_leaders_ack_waits_until_every_shard_holds_the_step(tmp_path: Path) -> None:
    c = Replies(tmp_path, shards=3)
    c.entry(1, 1)
    c.entry(0, 1, partials=[1.0, 2.0, 3.0])
    assert c.acks(0) == [] and c.acks(1) == [("logged", 1)], "shard 2's entry of step 1 is not here yet"
    c.entry(2, 1)
    assert c.acks(0) == [("logged", 1)] and c.acks(2) == [("logged", 1)]
    c.entry(2, 2)
    c.entry(1, 2)
    c.entry(0, 2)  # the shards' entries first (the usual order: they ship with shard_ready): acked at once
    assert c.acks(0) == [("logged", 1), ("logged", 2)]
    c.entry(1, 4)
    assert c.acks(1)[-1] == ("log_gap", 4), "step 3 is in no entry of shard 1"


def test_replays_end_at_the_leaders_log_end_and_drop_what_lies_past_it(tmp_path: Path) -> None:
    c = Replies(tmp_path, shards=2)
    for s in (1, 2, 3):
        c.entry(1, s)
        c.entry(0, s, skip=s == 2, partials=[float(s), 0.5])
    c.entry(1, 4)  # shard 1 shipped step 4 with its shard_ready; the leader died before applying it
    assert [c.req(0, a)[0] for a in (0, 1, 2)] == ["log_entry"] * 3
    mtype, fields, tensors = c.req(0, 3)
    assert mtype == "log_end" and fields == {"after": 3}
    assert sorted(c.log.logs[1].entries) == [1, 2, 3], "shard 1's step 4 was never committed: dropped"
    # shard 1 replays its own slices with the leader's decisions, to the leader's log end
    mtype, fields, tensors = c.req(1, 1)
    assert mtype == "log_entry" and fields["step"] == 2 and fields["skip"] and fields["partials"] == [2.0, 0.5]
    assert tensors is not None and torch.equal(tensors["g.w"], torch.full((2,), 12.0))
    assert c.req(1, 3)[0] == "log_end"
    assert [k for k, _ in c.events] == []


def test_a_shard_restored_before_the_logs_base_replays_nothing_and_cuts_nothing(tmp_path: Path) -> None:
    c = Replies(tmp_path, shards=2)
    for s in (1, 2, 3, 4):
        c.entry(1, s)
        c.entry(0, s, partials=[1.0, 1.0])
    c.log.covered(2)  # a checkpoint of step 2 written since the leader restored step 0
    assert c.req(1, 0, term=1)[0] == "log_end"
    assert sorted(c.log.logs[1].entries) == [3, 4] and sorted(c.log.logs[0].entries) == [3, 4]
    assert c.req(0, 2)[0] == "log_entry", "the leader's next term replays from the newest checkpoint"


class FakeLink:
    """StepLogLink's surface ShardStepLog uses: what was sent, the answers queued, whether the checkpointer moved."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.answers: list[SimpleNamespace] = []
        self.moved_now = False
        self.queue: list[Any] = []  # (the SendQueue's: nothing waits to go)

    def encode(self, step: int, grads: Any, *_: Any, **__: Any) -> list[list[Any]]:
        return [[step]]

    def send(self, msgs: list[list[Any]]) -> None:
        self.sent.append(msgs[0][0])

    def replies(self) -> list[SimpleNamespace]:
        out, self.answers = self.answers, []
        return out

    def moved(self) -> bool:
        return self.moved_now

    def answer(self, mtype: str, step: int) -> None:
        self.answers.append(SimpleNamespace(type=mtype, header={"step": step}))


def shard_log(link: FakeLink) -> Any:
    from cmemi.services.aggregator.steplog.shard import ShardStepLog

    log = ShardStepLog.__new__(ShardStepLog)  # (its link is the fake: no context, no socket)
    log.link, log.kept, log.again_at, log.next_check, log.shipped = link, {}, None, 0.0, -1
    log.resend_s, log.sent_at = 2.0, 0.0  # (resend_after's, at cluster.dead_after 2 s)
    log.boundary, log.restored = None, None
    return log


def test_a_shard_ships_once_per_step_keeps_at_most_two_entries_and_sends_them_again_after_a_gap() -> None:
    link = FakeLink()
    log = shard_log(link)
    log.ship(5, None)
    log.ship(5, None)  # shard_ready said again (the leader may have missed it): the entry is not
    assert link.sent == [5]
    log.ship(6, None)
    log.ship(7, None)  # the leader committed 6 only after its ack of 5: 5 is held, whatever its own ack
    assert sorted(log.kept) == [6, 7]
    link.answer("logged", 6)
    link.answer("log_gap", 7)  # a restarted checkpointer: nothing held until the forced checkpoint is written
    log.poll()
    assert sorted(log.kept) == [7] and link.sent == [5, 6, 7]
    log.again_at = 0.0  # (its half second passed)
    log.poll()
    assert link.sent == [5, 6, 7, 7], "sent again after the gap"
    link.answer("logged", 7)
    log.poll()
    assert log.kept == {}


def test_a_shard_sends_what_it_keeps_to_a_restarted_checkpointer() -> None:
    link = FakeLink()
    log = shard_log(link)
    log.ship(3, None)
    log.kept[3] = (log.kept[3][0] - 10.0, log.kept[3][1])  # its ack is late
    log.poll()
    assert link.sent == [3], "the same checkpointer: nothing sent again"
    link.moved_now, log.next_check = True, 0.0
    log.poll()
    assert link.sent == [3, 3]


def test_a_shard_sends_what_it_keeps_again_when_no_ack_came_within_resend_s_of_the_last_send() -> None:
    """The same checkpointer, an entry lost with a connection a cut ended (issue 47, the 300-fault soak's stall):
    sent again `resend_s` after it was last sent, and again `resend_s` after that, until it is logged."""
    link = FakeLink()
    log = shard_log(link)
    log.ship(3, None)
    log.ship(4, None)
    log.poll()
    assert link.sent == [3, 4], "just sent: not again"
    log.sent_at -= log.resend_s  # (resend_s passed)
    log.poll()
    assert link.sent == [3, 4, 3, 4], "both kept entries again, in order"
    log.poll()
    assert link.sent == [3, 4, 3, 4], "not again before another resend_s"
    link.queue.append(["still waiting"])
    log.sent_at -= log.resend_s
    log.poll()
    assert link.sent == [3, 4, 3, 4], "not while the last copy still waits to go (the link's SendQueue)"
    link.queue.clear()
    link.answer("logged", 3)
    link.answer("logged", 4)
    log.poll()
    assert log.kept == {}


class HeldLog:
    """The checkpointer's side of a replay (steplog/reading.py `LogEntries`): the merged entries it holds, in order,
    and nothing past its end: `end` moves when the leader's entry of its last step arrives."""

    def __init__(self, entries: list[SimpleNamespace]) -> None:
        self.all, self.end = entries, 0

    def __call__(self, _link: Any) -> HeldLog:
        return self

    def entries(self, after: int, lend: bool = False, count: int = 1) -> Any:
        yield from (e for e in self.all if after < e.header["step"] <= self.end)


def test_a_shard_told_it_is_behind_replays_on_from_where_it_ended_and_names_the_checkpoint_it_restored(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Issue 47's flake (tests/test_steplog_sharded.py, seed 376012946, `checkpoint == 0`): a shard restarted within
    the term replays to the log's end, one step short of the leader (its entry of that step still on its way), is
    told `shard_behind` and replays on. That second replay goes on from the first one's end (nothing applied twice:
    bitwise a straight run's five steps) and names the checkpoint the process restored, 0, not where it started.
    The one-line change that fails this: ShardStepLog.replay not passing `checkpoint=self.restored`."""
    from cmemi.services.aggregator.common.totals import RunTotals
    from cmemi.services.aggregator.common.trainer import Trainer
    from cmemi.services.aggregator.steplog import replay as replay_module
    from cmemi.services.aggregator.steplog.link import inputs_of, tensors_of
    from cmemi.shared.config.loading import load_config

    from tests.conftest import DIGITS

    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", "cluster.shards=2"])
    replayed, straight = Trainer(cfg, shard=1), Trainer(cfg, shard=1)
    g = torch.Generator().manual_seed(0)
    held = HeldLog([])
    for step in range(1, 6):
        grads = {n: torch.randn(p.shape, generator=g) for n, p in straight.pieces.items()}
        header = {"step": step, "skip": False, "evals": None, "partials": None, "loss": 1.0 / step}
        held.all.append(SimpleNamespace(header=header, tensors=tensors_of(grads, None)))
        straight.apply(*inputs_of(tensors_of(grads, None), False))
    monkeypatch.setattr(replay_module, "LogEntries", held)
    emitted: list[dict[str, Any]] = []
    quiet = SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None)
    redis = SimpleNamespace(hget=lambda key, field: "4" if field == "step" else None)  # the leader's progress
    ctx = SimpleNamespace(cfg=cfg, run_dir=tmp_path, log=quiet, redis=redis,
                          keys=SimpleNamespace(aggregator="aggregator", progress="progress"),
                          emit=lambda kind, **fields: emitted.append({"kind": kind, **fields}),
                          fatal=lambda why: pytest.fail(why))
    log = shard_log(FakeLink())
    held.end = 3  # the leader is at 4: its entry of step 4 still on its way
    assert log.replay(ctx, replayed, RunTotals()) == 3
    held.end = 5
    assert log.replay(ctx, replayed, RunTotals(), upto=4) == 4  # told shard_behind(4)
    assert log.replay(ctx, replayed, RunTotals(), upto=5) == 5  # and once more
    got = [(e["checkpoint"], e["start"], e["replayed"], e["step"]) for e in emitted]
    assert got == [(0, 0, 3, 3), (0, 3, 1, 4), (0, 4, 1, 5)], got
    assert replayed.params_sha256() == straight.params_sha256()
