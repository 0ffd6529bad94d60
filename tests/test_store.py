"""Checkpoint store: atomic layout, verification catches damage, retention keeps exactly what it should."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cmemi.services.checkpointer.store import CheckpointStore
from cmemi.shared.wire import state


def write(store: CheckpointStore, step: int) -> Path:
    meta, tensors = state.flatten({"model": {"w": torch.full((4, 4), float(step))}, "progress": {"step": step}})
    return store.write(step, meta, tensors)


def test_write_load_round_trip(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = write(store, 7)
    assert path.name == "step-00000007" and store.verify(path) is None
    meta, tensors = store.load(path)
    restored = state.unflatten(meta, tensors)
    assert torch.equal(restored["model"]["w"], torch.full((4, 4), 7.0)) and restored["progress"]["step"] == 7
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "missing"])
def test_verify_catches_damage_and_latest_good_falls_back(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(tmp_path)
    write(store, 1)
    newest = write(store, 2)
    f = newest / "model.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "manifest":
        (newest / "MANIFEST.json").write_text("{not json")
    else:
        f.unlink()
    assert store.verify(newest) is not None
    good = store.latest_good()
    assert good is not None and good.step == 1


def test_retention_keeps_last_milestones_and_latest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in range(10, 310, 10):
        write(store, step)
        store.retain(keep_last=3, keep_every=100, protect=step)
    assert [i.step for i in store.list()] == [100, 200, 280, 290, 300]
    assert store.retain(keep_last=1, keep_every=0, protect=290) == [100, 200, 280]
    assert [i.step for i in store.list()] == [290, 300]


def test_leftovers_of_interrupted_writes_are_cleaned(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    (tmp_path / ".tmp-step-00000005-123-456").mkdir()
    assert store.clean_leftovers() == [".tmp-step-00000005-123-456"]
    assert store.list() == []


def test_optimizer_and_scheduler_state_round_trip_without_pickle() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
    meta, tensors = state.flatten({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()})
    import msgpack

    meta = msgpack.unpackb(msgpack.packb(meta), strict_map_key=True)  # what the wire does to it
    back = state.unflatten(meta, tensors)
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.01)  # built as the aggregator builds them, then restored
    sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.1, total_steps=10)
    opt2.load_state_dict(back["optimizer"])
    sched2.load_state_dict(back["scheduler"])
    g1, g2 = opt.state_dict()["param_groups"][0], opt2.state_dict()["param_groups"][0]
    assert tuple(g1["betas"]) == tuple(g2["betas"]) and g1["lr"] == g2["lr"]
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt2.state_dict()["state"][0][k]))
    assert sched2.get_last_lr() == sched.get_last_lr()
    with pytest.raises(state.StateError, match="without pickle"):
        state.flatten({"x": object()})


def test_manifests_with_sha256_from_earlier_versions_still_verify(tmp_path: Path) -> None:
    import hashlib
    import json

    store = CheckpointStore(tmp_path)
    path = write(store, 3)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    for name, entry in manifest["files"].items():
        assert set(entry) == {"bytes", "xxh3_128"}
        del entry["xxh3_128"]
        entry["sha256"] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    assert store.verify(path) is None
    data = bytearray((path / "meta.json").read_bytes())
    data[0] ^= 0xFF
    (path / "meta.json").write_bytes(bytes(data))
    assert store.verify(path) == "meta.json checksum mismatch"
