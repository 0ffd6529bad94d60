"""The step log's parts without processes: the checkpointer's store (held, gaps, covered, cut, spilled past its
bound) and a replay through a real Trainer ending bitwise where the original steps ended."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.steplog.link import inputs_of, tensors_of
from cmemi.services.checkpointer import spool
from cmemi.services.checkpointer.steplog import Held, SlotBytes, StepLog
from cmemi.shared.config.loading import load_config
from cmemi.shared.wire.protocol import DTYPE_NAMES

from tests.conftest import DIGITS


def metas(tensors: dict[str, torch.Tensor]) -> list[dict]:
    return [{"name": n, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "nbytes": t.nbytes}
            for n, t in tensors.items()]


def arrive(log: StepLog, step: int, tensors: dict[str, torch.Tensor], shard: int = 0) -> bool:
    """An entry as the Assembler lands it: its bytes written range by range into the sink the log chose."""
    sink = log.sink({"step": step, "shard": shard}, metas(tensors))
    for i, t in enumerate(tensors.values()):
        raw = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        sink.write(i, 0, raw[: len(raw) // 2])
        sink.write(i, len(raw) // 2, raw[len(raw) // 2:])
    fields = {"step": step, "skip": False, "loss": float(step), "partials": None}
    return log.add(shard, fields, sink.result())


def grad(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"g.w": torch.randn(4, 3, generator=g), "g.b": torch.randn(3, generator=g)}


def spill_to(tmp_path: Path):
    return lambda of, m: spool.Spool(tmp_path, of["step"], of["shard"], m, lambda exc, attempt: None)


def test_entries_are_held_in_order_and_a_gap_is_refused(tmp_path: Path) -> None:
    log = StepLog(10, 1 << 20, spill_to(tmp_path))
    assert arrive(log, 11, grad(11)) and arrive(log, 12, grad(12))
    assert arrive(log, 12, grad(12))  # sent again (a restarted checkpointer's resend): held already
    assert arrive(log, 9, grad(9))  # covered by the checkpoint: nothing to hold
    assert not arrive(log, 14, grad(14))  # 13 is in no entry: a gap
    assert sorted(log.logs[0].entries) == [11, 12]
    e = log.entry(0, 12)
    assert e is not None and torch.equal(e.loaded()["g.w"], grad(12)["g.w"]) and e.fields["loss"] == 12.0
    assert log.in_memory == sum(t.nbytes for t in grad(11).values()) * 2


def test_a_checkpoint_drops_what_it_covers_and_rebases_the_log(tmp_path: Path) -> None:
    log = StepLog(0, 1 << 20, spill_to(tmp_path))
    for s in range(1, 6):
        assert arrive(log, s, grad(s))
    log.covered(3)
    assert sorted(log.logs[0].entries) == [4, 5] and log.base_of(0) == 3
    assert log.in_memory == sum(t.nbytes for t in grad(0).values()) * 2
    log.covered(5)
    assert log.logs[0].entries == {} and log.in_memory == 0
    assert arrive(log, 6, grad(6)) and not arrive(log, 8, grad(8))


def test_a_restart_from_an_older_checkpoint_cuts_the_log_there(tmp_path: Path) -> None:
    log = StepLog(0, 1 << 20, spill_to(tmp_path))
    for s in range(1, 4):
        arrive(log, s, grad(s))
    log.covered(2)
    log.restart_at(0, 2)  # the newest checkpoint restored: the log replays as it is
    assert sorted(log.logs[0].entries) == [3]
    log.restart_at(0, 0)  # an older one (the newest damaged): nothing after it can be replayed
    assert log.logs[0].entries == {} and log.base_of(0) == 0
    assert arrive(log, 1, grad(1))


def test_past_its_memory_bound_the_log_spools_to_disk_and_reads_back(tmp_path: Path) -> None:
    one = sum(t.nbytes for t in grad(0).values())
    log = StepLog(0, one, spill_to(tmp_path))  # room for one entry in memory
    for s in range(1, 4):
        assert arrive(log, s, grad(s))
    assert isinstance(log.sink({"step": 4, "shard": 0}, metas(grad(4))), spool.Spool)
    assert log.in_memory == one and log.spilled == 3
    held = log.entry(0, 1)
    on_disk = log.entry(0, 3)
    assert held is not None and on_disk is not None
    assert all(isinstance(t, spool.Spooled) for t in on_disk.tensors.values())
    for step, entry in ((1, held), (3, on_disk)):
        assert all(torch.equal(entry.loaded()[n], t) for n, t in grad(step).items())
    log.covered(3)
    assert list(tmp_path.glob(".tmp-spool-00000003-*")) == []  # a covered entry's spool file goes with it
    log.clear()


def test_each_shard_keeps_its_own_log(tmp_path: Path) -> None:
    log = StepLog(0, 1 << 20, spill_to(tmp_path))
    assert arrive(log, 1, grad(1), shard=0) and arrive(log, 1, grad(1), shard=1) and arrive(log, 2, grad(2), shard=1)
    assert sorted(log.logs[0].entries) == [1] and sorted(log.logs[1].entries) == [1, 2]


def test_a_held_entry_lands_each_range_at_its_place() -> None:
    t = {"x": torch.arange(10, dtype=torch.float32)}
    sink = Held(metas(t))
    raw = memoryview(t["x"].numpy().tobytes())
    sink.write(0, 8, raw[8:])
    sink.write(0, 0, raw[:8])
    assert torch.equal(sink.result()["x"], t["x"])


@pytest.mark.parametrize("sets", [(), ("train.clip_grad_norm=0.5",)])
def test_a_replay_of_the_shipped_inputs_ends_bitwise_where_the_steps_ended(tmp_path: Path, sets: tuple) -> None:
    """Two trainers of the same config: one steps (clipping in place, where set), the other only replays what the
    first shipped for each step (one of them a skipped step); their states hash the same."""
    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", *sets])
    live, replayed = Trainer(cfg), Trainer(cfg)
    g = torch.Generator().manual_seed(0)
    shipped = []
    for step in range(1, 8):
        grads = None if step == 4 else {n: torch.randn(s, generator=g) for n, s in live.shapes.items()}
        shipped.append((tensors_of(grads, None), grads is None))
        live.apply(grads)
    for tensors, skip in shipped:
        grads, buffer_sum = inputs_of(tensors, skip)
        replayed.apply(grads, buffer_sum)
    assert replayed.step == live.step == 7 and replayed.skipped == live.skipped == 1
    assert replayed.params_sha256() == live.params_sha256()
    assert replayed.optimizer.state_dict()["state"].keys() == live.optimizer.state_dict()["state"].keys()
    assert replayed.lr == live.lr


def test_a_held_entry_of_every_shape_and_dtype_lands_whole() -> None:
    """One buffer per entry, its tensors views at aligned offsets: odd sizes, a scalar, an empty tensor, bf16."""
    t = {"a": torch.arange(7, dtype=torch.float64), "s": torch.tensor(3.5), "e": torch.empty(0, 4),
         "h": torch.arange(5, dtype=torch.bfloat16), "i": torch.arange(3, dtype=torch.int64).reshape(3, 1)}
    sink = Held(metas(t))
    for i, x in enumerate(t.values()):
        sink.write(i, 0, memoryview(x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()))
    got = sink.result()
    assert all(got[n].dtype == x.dtype and got[n].shape == x.shape and torch.equal(got[n], x) for n, x in t.items())
    filled = Held(metas(t))
    desc = {"seg": "s", "slot": 0, "at": [0] * len(t), "tensors": metas(t)}
    raw = SlotBytes()
    filled.fill(raw.of(desc, t))
    assert raw.of(desc, t) is raw.of(desc, t)  # the same views: their bytes are not made again
    log = StepLog(0, 1 << 20, lambda _h, _m: None)  # type: ignore[arg-type,return-value]
    assert log.add(0, {"step": 1}, filled.pieces())  # held as it landed from a slot: no tensor views made
    entry = log.entry(0, 1)
    assert entry is not None and entry.nbytes == sum(x.nbytes for x in t.values())
    assert all(torch.equal(entry.loaded()[n], x) and entry.loaded()[n].dtype == x.dtype for n, x in t.items())
    assert all(torch.equal(filled.result()[n], x) for n, x in t.items())



def test_the_log_end_follows_every_cut() -> None:
    log = StepLog(0, 1 << 20, lambda _h, _m: None)  # type: ignore[arg-type,return-value]
    for s in range(1, 6):
        assert arrive(log, s, grad(s))
    assert log.logs[0].last == 5
    log.covered(2)
    assert log.logs[0].last == 5 and not arrive(log, 7, grad(7)) and arrive(log, 6, grad(6))
    log.truncate(4)
    assert log.logs[0].last == 4 and sorted(log.logs[0].entries) == [3, 4] and arrive(log, 5, grad(5))
    log.covered(9)
    assert log.logs[0].last == 9 and arrive(log, 10, grad(10))
