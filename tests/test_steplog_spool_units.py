"""The step log written through to its segment files and read back by a restarted checkpointer (issue 47,
services/checkpointer/logfiles.py): entries back bitwise after a "restart" (a new StepLog on the same directory), a
torn tail and a corrupt entry cut and counted (never raised), retention by checkpoints, the live log's cuts obeyed on
read-back, entries past the memory bound served from the segment, and a replay answered after the restart."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from cmemi.services.checkpointer import logfiles
from cmemi.services.checkpointer.logfiles import LogFiles, Stored
from cmemi.services.checkpointer.steplog import StepLog
from cmemi.services.checkpointer.steplog_replies import LogReplies
from cmemi.shared.wire import protocol

from tests.test_steplog_units import arrive, grad, spill_to


def full(exc: OSError, attempt: int) -> None:
    raise AssertionError(f"no disk-full expected: {exc} (attempt {attempt})")


def opened(root: Path, spill: Path, base: int = 0, memory: int = 1 << 20) -> StepLog:
    return StepLog(base, memory, spill_to(spill), LogFiles(root, full))


def restarted(root: Path, spill: Path, base: int = 0) -> tuple[StepLog, dict[str, int]]:
    """A new process's log on the same directory, read back (as services/checkpointer/server.py does at start)."""
    log = opened(root, spill, base)
    return log, log.recover()


def held(log: StepLog, shard: int = 0) -> list[int]:
    return sorted(log.logs[shard].entries) if shard in log.logs else []


def same(log: StepLog, step: int, shard: int = 0, of: int | None = None) -> bool:
    e = log.entry(shard, step)
    want = grad(step if of is None else of)
    return e is not None and e.fields["loss"] == float(step) and \
        all(torch.equal(e.loaded()[n], t) for n, t in want.items())


def segments(root: Path) -> list[Path]:
    return sorted(root.glob("seg-*.log"))


def test_every_held_entry_is_on_disk_and_read_back_bitwise_after_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "steplog"
    log = opened(root, tmp_path)
    for s in range(1, 6):
        assert arrive(log, s, grad(s)) and arrive(log, s, grad(s), shard=1)
    assert arrive(log, 5, grad(5))  # sent again: held already, not written twice
    assert log.files is not None and log.files.written == 10
    log.files.close()  # the process dies: nothing but what is on disk goes on
    back, got = restarted(root, tmp_path)
    assert got == {"entries": 10, "torn": 0, "corrupt": 0, "dropped": 0, "lost": 0, "cut_bytes": 0}, got
    assert held(back) == held(back, 1) == [1, 2, 3, 4, 5]
    assert all(same(back, s, k) for s in range(1, 6) for k in (0, 1))
    e = back.entry(0, 3)
    assert e is not None and all(isinstance(t, Stored) for t in e.tensors.values()) and back.in_memory == 0
    assert arrive(back, 6, grad(6)) and not arrive(back, 8, grad(8))  # the log goes on where it ended: 7 is a gap
    assert back.files is not None and len(segments(root)) == 2  # a new segment for what this process writes


def test_a_torn_tail_is_cut_at_the_last_whole_entry_and_counted(tmp_path: Path) -> None:
    root = tmp_path / "steplog"
    log = opened(root, tmp_path)
    for s in range(1, 5):
        assert arrive(log, s, grad(s))
    assert log.files is not None
    log.files.close()
    seg = segments(root)[-1]
    whole = seg.stat().st_size
    os.truncate(seg, whole - 7)  # the process died inside its last write
    back, got = restarted(root, tmp_path)
    assert held(back) == [1, 2, 3] and got["torn"] == 1 and got["lost"] == 0, got
    assert 0 < got["cut_bytes"] < whole and seg.stat().st_size == whole - 7 - got["cut_bytes"]
    assert all(same(back, s) for s in (1, 2, 3))
    assert arrive(back, 4, grad(4))  # the server sends the unacknowledged entry again: held
    assert back.files is not None
    back.files.close()
    again, got = restarted(root, tmp_path)
    assert held(again) == [1, 2, 3, 4] and got["torn"] == 0 and same(again, 4)


def test_a_corrupt_entry_ends_the_log_there_and_is_counted_as_lost(tmp_path: Path) -> None:
    root = tmp_path / "steplog"
    log = opened(root, tmp_path)
    for s in range(1, 6):
        assert arrive(log, s, grad(s))
    e = log.entry(0, 3)
    assert log.files is not None and e is not None
    log.files.close()
    stored = logfiles.LogFiles(root, full).recover().records[2].tensors["g.w"]
    with open(stored.segment.path, "r+b") as f:  # one byte of step 3's gradient flipped on disk
        f.seek(stored.offset + 5)
        b = f.read(1)
        f.seek(stored.offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    back, got = restarted(root, tmp_path)
    assert held(back) == [1, 2] and got["corrupt"] == 1 and got["lost"] == 1, got
    assert all(same(back, s) for s in (1, 2))
    garbage = root / "seg-00000099.log"
    garbage.write_bytes(os.urandom(100))  # not a record at all
    assert back.files is not None
    back.files.close()
    again, got = restarted(root, tmp_path)
    assert got["corrupt"] == 1 and not garbage.exists() and held(again) == [1, 2]


def test_a_checkpoint_deletes_the_segments_it_covers_and_the_disk_stays_bounded(tmp_path: Path) -> None:
    root = tmp_path / "steplog"
    log = opened(root, tmp_path)
    for s in range(1, 101):
        assert arrive(log, s, grad(s))
        if s % 20 == 0:
            log.covered(s - 2)  # a checkpoint of a step a little behind the log's end, as a running server's
            assert len(segments(root)) <= 2, (s, segments(root))
    assert held(log) == [99, 100]
    assert log.files is not None
    log.files.close()
    back, got = restarted(root, tmp_path, base=98)
    assert held(back) == [99, 100] and got["entries"] == 2 and same(back, 100)
    back.covered(100)
    assert segments(root) == [], "a checkpoint of the log's end leaves no segment"


def test_the_read_back_log_follows_the_live_logs_cuts(tmp_path: Path) -> None:
    """Sharded: the leader's log end drops what was never committed, and the new term ships those steps again,
    other values: read back, the later record of a step wins and what followed the cut one is gone."""
    root = tmp_path / "steplog"
    log = opened(root, tmp_path)
    for s in range(1, 6):
        assert arrive(log, s, grad(s))
    log.truncate(3)
    assert arrive(log, 4, grad(40))
    assert log.files is not None
    log.files.close()
    back, got = restarted(root, tmp_path)
    assert held(back) == [1, 2, 3, 4] and got["lost"] == 0 and same(back, 4, of=40), got


def test_entries_past_the_memory_bound_are_kept_only_in_their_segment(tmp_path: Path) -> None:
    root = tmp_path / "steplog"
    one = sum(t.nbytes for t in grad(1).values())
    log = opened(root, tmp_path, memory=one)
    for s in range(1, 5):
        assert arrive(log, s, grad(s))
    assert log.in_memory == one and log.spilled == 3
    assert list(tmp_path.glob(".tmp-spool-*")) == [], "a spilled entry's spool file goes once its segment holds it"
    e = log.entry(0, 3)
    assert e is not None and all(isinstance(t, Stored) for t in e.tensors.values())
    assert all(same(log, s) for s in range(1, 5))


class Replies:
    def __init__(self, log: StepLog) -> None:
        self.sent: list[tuple[str, dict, dict | None]] = []
        self.replies = LogReplies(log, lambda _i, t, f, tensors=None: self.sent.append((t, f, tensors)),
                                  lambda *a, **k: None, shards=1)

    def __call__(self, mtype: str, **header) -> tuple[str, dict, dict | None]:
        self.replies.handle(b"leader", protocol.Message({"type": mtype, "term": 2, "shard": 0, **header}, {}))
        return self.sent[-1]


def test_after_a_restart_a_resent_entry_is_logged_and_a_replay_finds_every_step(tmp_path: Path) -> None:
    """What the servers see of a restarted checkpointer: the unacknowledged entry sent again is `logged` (no
    `log_gap`, no forced checkpoint), and a restarted leader's replay is answered every step from the files."""
    root = tmp_path / "steplog"
    log = opened(root, tmp_path)
    for s in range(1, 8):
        assert arrive(log, s, grad(s))
    assert log.files is not None
    log.files.close()
    back, _ = restarted(root, tmp_path)
    ask = Replies(back)
    assert ask("step_log", step=7, skip=False, loss=7.0, partials=None, evals=None)[0] == "logged"
    for after in range(0, 7):
        kind, fields, tensors = ask("log_req", after=after)
        assert kind == "log_entry" and fields["step"] == after + 1 and tensors is not None
        assert all(torch.equal(tensors[n], x) for n, x in grad(after + 1).items())
    assert ask("log_req", after=7)[0] == "log_end"


def test_a_new_cmemi_up_or_the_spool_off_removes_the_segments_instead_of_reading_them_back(tmp_path: Path) -> None:
    """Read back only by a restart within the run: a `--resume` (Redis's keys cleared by `cmemi up`) starts from the
    checkpoint as before, and with checkpoint.step_log_spool false there are no segments at all."""
    root = tmp_path / "steplog"
    for read_back, spool_on, kept in ((True, True, 3), (False, True, 0), (True, False, 0)):
        log = opened(root, tmp_path)
        for s in range(1, 4):
            assert arrive(log, s, grad(s))
        assert log.files is not None
        log.files.close()
        files, removed = logfiles.opened(root, spool_on, read_back, full)
        assert (files is None) == (not spool_on) and removed == (0 if kept else 1), (read_back, spool_on, removed)
        if files is not None:
            back = StepLog(0, 1 << 20, spill_to(tmp_path), files)
            assert back.recover()["entries"] == kept and held(back) == list(range(1, kept + 1))
            files.close()
        for p in segments(root):
            p.unlink()
