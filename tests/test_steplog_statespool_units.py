"""A server's state spool (issue 48, services/aggregator/steplog/statespool.py), without processes: the replicas'
states a step makes current written on the server's own host and read back bitwise, an entry that carries only its
`g.`/`b.` tensors and a reference, a record that is gone or damaged at a replay -> the fallback (the replay stops
before that step, the log is cut there, `state_spool_lost` and `steps_redone` say so), and retention by checkpoint.

The one-line change that fails these: `StateSpool.read` returning `{}` instead of the record's tensors (the restore
then finds no state: `test_a_replay_through_the_spool...` and `test_write_and_read_back...` fail)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import torch
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.steplog import replay as replaying
from cmemi.services.aggregator.steplog.statespool import Lost, StateSpool

from tests.test_steplog_local_units import config, logged_rounds, same_state


def test_write_and_read_back_bitwise_every_dtype_and_shape(tmp_path) -> None:
    spool = StateSpool(tmp_path / "states-0")
    want = {"i.0.a": torch.randn(3, 5), "i.0.b": torch.arange(7, dtype=torch.int64), "i.1.c": torch.tensor(2.5),
            "i.1.d": torch.empty(0, 4), "i.1.e": torch.randn(9).to(torch.bfloat16), "i.1.f": torch.tensor([True])}
    ref = spool.write(3, want)
    got = spool.read(ref, 3)
    assert got.keys() == want.keys()
    assert all(g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w) for g, w in
               ((got[n], want[n]) for n in want))
    again = StateSpool(tmp_path / "states-0")  # a restarted server: the records of the dead one read back
    assert all(torch.equal(again.read(ref, 3)[n], want[n]) for n in want)
    second = again.write(4, {"i.0.a": want["i.0.a"] * 2})  # ... and its own go to a new segment
    assert second[0] == ref[0] + 1 and torch.equal(again.read(second, 4)["i.0.a"], want["i.0.a"] * 2)


def test_a_record_gone_damaged_or_another_steps_is_lost(tmp_path) -> None:
    spool = StateSpool(tmp_path)
    ref = spool.write(5, {"i.0.a": torch.randn(100)})
    with pytest.raises(Lost, match="not step 6's|step 5's states, not step 6's"):
        spool.read(ref, 6)
    with pytest.raises(Lost, match="names no record"):
        spool.read([1, 2], 5)
    path = spool.path(ref[0])
    raw = bytearray(path.read_bytes())
    raw[ref[1] + ref[2] // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(Lost, match="corrupt"):
        spool.read(ref, 5)
    path.write_bytes(bytes(raw[:ref[2] // 2]))
    with pytest.raises(Lost, match="torn"):
        spool.read(ref, 5)
    path.unlink()
    with pytest.raises(Lost, match="cannot be read"):
        spool.read(ref, 5)


def test_retention_keeps_the_segments_since_the_checkpoint_before_last(tmp_path) -> None:
    old = StateSpool(tmp_path)
    old.write(1, {"i.0.a": torch.ones(4)})  # a previous process's segment
    spool = StateSpool(tmp_path)
    refs = {}
    for step in range(2, 11):
        refs[step] = spool.write(step, {"i.0.a": torch.full((4,), float(step))})
        if step in (4, 7, 10):  # checkpoints written at 4, 7, 10: each closes the open segment
            spool.covered(step)
    files = sorted(p.name for p in Path(tmp_path).glob("st-*.log"))
    # kept: what the checkpoint before last (7) does not cover, i.e. steps 8..10's segment; 2..4's and 5..7's went at
    # the checkpoints of 7 and 10, and the previous process's at this one's second checkpoint
    assert files == [spool.path(refs[10][0]).name]
    assert torch.equal(spool.read(refs[8], 8)["i.0.a"], torch.full((4,), 8.0))
    with pytest.raises(Lost):
        spool.read(refs[5], 5)


def rounds(tmp_path, spool: StateSpool | None, n: int = 3) -> tuple[Trainer, list[Any]]:
    """`n` rounds of two replicas (real LocalRounds) applied by a live Trainer; each round's entry as the
    checkpointer gets it (through the wire), its states in `spool` when one is given."""
    cfg = config(tmp_path)
    live = Trainer(cfg)
    entries = logged_rounds(cfg, live, n, spool)
    return live, entries


def test_an_entry_carries_only_its_g_and_b_tensors_and_a_reference(tmp_path) -> None:
    spool = StateSpool(tmp_path / "states-0")
    _, spooled = rounds(tmp_path, spool, 1)
    _, inline = rounds(tmp_path, None, 1)
    names = set(spooled[0].tensors)
    assert names and all(n.startswith(("g.", "b.")) for n in names)
    assert any(n.startswith("i.") for n in inline[0].tensors)  # without a spool: the states in the entry, as before
    assert [len(item) for item in spooled[0].header["replicas"]] == [3, 3]
    size = sum(t.numel() * t.element_size() for t in spooled[0].tensors.values())
    assert size == sum(t.numel() * t.element_size() for n, t in inline[0].tensors.items() if not n.startswith("i."))
    assert spool.written_bytes > size  # the states, two replicas' AdamW moments and more, went to the spool


class FakeEntries:
    """LogEntries' surface replay uses: the entries handed in, and the cut it was asked for."""

    cuts: list[int] = []

    def __init__(self, link: Any) -> None:
        self.link = link

    def entries(self, after: int, lend: bool = False, count: int = 1) -> Any:
        yield from [m for m in self.link.log if m.header["step"] > after]

    def cut(self, after: int) -> None:
        FakeEntries.cuts.append(after)


def fake_ctx(tmp_path, committed: int) -> Any:
    class Redis:
        def hget(self, *_: Any) -> Any:
            raise redis.RedisError("away")

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": committed, "loss": 1.0}) + "\n")
    events: list[tuple[str, dict[str, Any]]] = []
    log = SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None)
    return SimpleNamespace(run_dir=tmp_path, redis=Redis(), keys=SimpleNamespace(progress="p"), log=log,
                           cfg=config(tmp_path), emit=lambda name, **f: events.append((name, f)), events=events,
                           fatal=lambda m: pytest.fail(m))


@pytest.mark.parametrize("damage", [None, "missing", "corrupt"])
def test_a_replay_through_the_spool_ends_bitwise_or_stops_where_a_record_is_lost(tmp_path, monkeypatch,
                                                                                  damage) -> None:
    """Three logged rounds replayed by a fresh Trainer reading the states back from the spool: bitwise the live one's.
    With round 2's record gone or damaged the replay stops after round 1, asks the log cut there, and says so."""
    spool = StateSpool(tmp_path / "states-0")
    live, entries = rounds(tmp_path, spool, 3)
    ref = entries[1].header["replicas"][0][2]
    if damage == "missing":
        spool.path(ref[0]).unlink()
    elif damage == "corrupt":
        with open(spool.path(ref[0]), "r+b") as f:
            f.seek(ref[1] + ref[2] - 20)
            f.write(b"\x00" * 8)
    monkeypatch.setattr(replaying, "LogEntries", FakeEntries)
    FakeEntries.cuts = []
    ctx = fake_ctx(tmp_path, committed=3)
    replayed = Trainer(ctx.cfg)
    assert replayed.inner is not None
    link = SimpleNamespace(log=entries, states=StateSpool(tmp_path / "states-0"))
    n = replaying.replay(ctx, replayed, link, RunTotals(), judge=True)
    names = [e[0] for e in ctx.events]
    if damage is None:
        assert n == 3 and replayed.params_sha256() == live.params_sha256() and FakeEntries.cuts == []
        assert all(same_state(replayed.inner.current[r], live.inner.current[r]) for r in range(2))
        assert "state_spool_lost" not in names and "steps_redone" not in names
        return
    assert n == 1 and replayed.step == 1 and FakeEntries.cuts == [1] and replayed.inner.next == {}
    lost = dict(ctx.events)["state_spool_lost"]
    assert lost["step"] == 1 and "state spool" in lost["reason"]
    redone = dict(ctx.events)["steps_redone"]
    assert redone["steps"] == 2 and "state spool" in redone["reason"]
