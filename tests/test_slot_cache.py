"""A slot's layout is paid once (shared/memory/shm.py, shm_reader.py, services/aggregator/common/publish.py): the
slot's byte tensor, the entries' checks and the views are made on a (segment, slot, layout)'s first read or write and
reused, while what changes from read to read — the sequence, the checksums, the bytes themselves — is checked and
read every time. Real segments under /dev/shm; each test has a run id of its own."""

from __future__ import annotations

import os

import pytest
import torch
from cmemi.services.aggregator.common.publish import SlotPublisher
from cmemi.shared.memory import shm, shm_reader
from cmemi.shared.wire.layout import Layout

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")


def grad(k: float) -> dict[str, torch.Tensor]:
    return {"flat.float32": torch.arange(4608, dtype=torch.float32) * k}


def counting(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Count the calls of `module.name` (it still runs)."""
    calls = [0]
    real = getattr(module, name)

    def counted(*args: object, **kw: object) -> object:
        calls[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_layout_is_sliced_once_per_slot_and_each_read_sees_the_slots_bytes(
        shm_run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w, r = shm.Writer(shm_run, "worker", False), shm_reader.Reader(shm_run, False)
    maps, slices = counting(monkeypatch, shm_reader, "slot_bytes"), counting(monkeypatch, shm_reader, "tensor_at")
    writes, placed = counting(monkeypatch, shm, "slot_bytes"), counting(monkeypatch, shm, "tensor_at")
    first: dict[int, torch.Tensor] = {}
    for k in range(1, 9):  # both slots, four versions each
        desc = w.write(grad(float(k)))
        got = r.views(desc)
        assert torch.equal(got["flat.float32"], grad(float(k))["flat.float32"]) and r.intact(desc)
        assert got["flat.float32"] is first.setdefault(desc["slot"], got["flat.float32"])  # made on the slot's first read
        got.pop("flat.float32")  # the dict is the caller's: the next read still has every tensor
    assert (maps[0], slices[0]) == (shm.SLOTS, shm.SLOTS)  # once per slot, not per read
    assert writes[0] == shm.SLOTS and placed[0] == shm.SLOTS  # the writer's alike (its segment made once)
    w.close()


def test_a_known_layout_still_checks_the_sequence_and_the_checksums(shm_run: str) -> None:
    w, r = shm.Writer(shm_run, "worker", True), shm_reader.Reader(shm_run, True)
    old = w.write(grad(1.0))
    r.views(old)  # its layout is known from here on
    w.write(grad(2.0))
    cur = w.write(grad(3.0))  # old's slot, written again
    with pytest.raises(shm.ShmError, match="shm_overwritten"):
        r.views(old)
    assert torch.equal(r.copied(cur)["flat.float32"], grad(3.0)["flat.float32"])
    bad = {**cur, "tensors": [{**cur["tensors"][0], "xxh": cur["tensors"][0]["xxh"] ^ 1}]}
    with pytest.raises(shm.ShmError, match="bad_checksum"):
        r.views(bad)
    w.close()


@pytest.mark.parametrize("n, shape", [(4608, [4608.0]), (1, [True])])
def test_an_entry_that_only_hashes_like_a_known_one_is_checked_afresh(shm_run: str, n: int, shape: list[object]) -> None:
    """4608.0 and True hash and compare like ints: a key of them would find the views checked for [4608] (or [1])."""
    w, r = shm.Writer(shm_run, "worker", False), shm_reader.Reader(shm_run, False)
    desc = w.write({"x": torch.ones(n)})
    r.views(desc)
    with pytest.raises(shm.ProtocolError) as exc:
        r.views({**desc, "tensors": [{**desc["tensors"][0], "shape": shape}]})
    assert exc.value.reason == "bad_shape"
    w.close()


def test_duplicate_names_in_a_known_layout_are_refused(shm_run: str) -> None:
    w, r = shm.Writer(shm_run, "worker", False), shm_reader.Reader(shm_run, False)
    desc = w.write({"a": torch.ones(16), "b": torch.zeros(16)})
    r.views(desc)
    dup = {**desc, "tensors": [desc["tensors"][0], {**desc["tensors"][1], "name": "a"}]}
    for _ in range(2):  # its first read and a second one
        with pytest.raises(shm.ShmError, match="bad_tensor"):
            r.views(dup)
    w.close()


def test_a_grown_segment_forgets_the_old_layouts_and_every_map_closes(shm_run: str) -> None:
    def fds() -> int:
        mine = f"/dev/shm/cmemi-{shm.run_tag(shm_run)}-"
        return sum(os.readlink(f"/proc/self/fd/{fd}").startswith(mine) for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    w, r = shm.Writer(shm_run, "worker", False), shm_reader.Reader(shm_run, False)
    small = w.write({"x": torch.ones(100)})
    big = w.write({"x": torch.full((100_000,), 2.0)})  # a new segment
    assert big["seg"] != small["seg"] and torch.equal(r.copied(big)["x"], torch.full((100_000,), 2.0))
    again = w.write({"x": torch.ones(100) * 3})  # the small layout again: in the new segment, not the old one's views
    assert again["seg"] == big["seg"] and torch.equal(r.copied(again)["x"], torch.ones(100) * 3)
    w.close()
    r.maps.clear()
    assert fds() == 0 and shm.owned(shm_run) == []  # cached views held no map open


def test_the_publisher_writes_each_version_into_views_made_once_per_slot(
        shm_run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    params = {"w": torch.randn(16, 5), "b": torch.randn(16), "n": torch.tensor([3])}
    layout = Layout(params)
    pub, r = SlotPublisher(shm_run, "leader", False, layout), shm_reader.Reader(shm_run, False)
    laid = counting(monkeypatch, layout, "views")
    for version in range(1, 6):
        with torch.no_grad():
            for p in params.values():
                p.add_(1)
        desc = pub.descriptor(params, version)
        assert pub.descriptor(params, version) is desc  # written once per version
        got = layout.views(r.copied(desc))
        assert all(torch.equal(got[n], p) for n, p in params.items())  # bitwise, in both slots
        assert pub.kept(version - 1) is not None or version == 1
    assert laid[0] == 5 + shm.SLOTS  # the reads above, and the publisher's once per slot
    pub.close()
    assert shm.owned(shm_run) == []
