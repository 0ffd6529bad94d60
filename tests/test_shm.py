"""Shared-memory slots (shared/memory/shm.py): what a reader takes, what it refuses, and what a SIGKILLed writer leaves.

Real segments under /dev/shm and real processes; each test uses a run id of its own and removes what it made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from cmemi.shared.memory import shm, shm_reader

from tests.conftest import ROOT
from tests.helpers.chaos import poll

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")


@pytest.fixture
def run(shm_run: str) -> str:
    return shm_run


def tensors(k: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(100, dtype=torch.float32) * k, "n": torch.tensor([3, 4], dtype=torch.int64),
            "empty": torch.empty(0, 5)}


def test_round_trip_in_both_slots_bitwise(run: str) -> None:
    w, r = shm.Writer(run, "worker", True), shm_reader.Reader(run, True)
    for k in (1.0, 2.0, 3.0):
        desc = w.write(tensors(k))
        got = r.copied(desc)
        assert all(torch.equal(got[n], t) for n, t in tensors(k).items())
    assert desc["slot"] == 0 and desc["seq"] == 4  # slots alternate; each write moves its slot's sequence by 2
    st = os.stat(shm.ROOT / desc["seg"])
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
    w.close()
    assert shm.owned(run) == []


def test_a_slot_rewritten_or_half_written_is_never_used(run: str) -> None:
    w, r = shm.Writer(run, "leader", False), shm_reader.Reader(run, False)
    old = w.write(tensors(1.0))
    w.write(tensors(2.0))
    views = r.views(w.write(tensors(3.0)) | {})  # the third write reuses the first one's slot
    del views
    with pytest.raises(shm.ShmError) as exc:  # v is gone from its slot: refused before a byte is read
        r.views(old)
    assert exc.value.reason == "shm_overwritten"
    # a reader that began while the slot was whole, and the writer wrote it again meanwhile: `intact` says no
    cur = w.write(tensors(4.0))
    views = r.views(cur)
    slot, open_views = w.begin(w.write(tensors(5.0))["tensors"])  # the next write of cur's slot, left unfinished
    assert slot == cur["slot"] and not r.intact(cur)
    with pytest.raises(shm.ShmError, match="shm_overwritten"):
        r.copied(cur)
    del views, open_views


def test_bad_descriptors_are_refused_with_a_reason(run: str, tmp_path) -> None:
    w, r = shm.Writer(run, "worker", True), shm_reader.Reader(run, True)
    desc = w.write(tensors())
    other = shm.Writer(f"{run}-other", "worker", False)
    foreign = other.write(tensors())
    try:
        cases = {
            "shm_bad": [None, {**desc, "seg": "../../etc/passwd"}, {**desc, "seg": foreign["seg"]},
                        {**desc, "slot": 2}, {**desc, "seq": 3}, {**desc, "at": desc["at"][:1]},
                        {**desc, "tensors": [{**desc["tensors"][0], "nbytes": True}, *desc["tensors"][1:]]}],
            "shm_bounds": [{**desc, "at": [1 << 30, *desc["at"][1:]]}, {**desc, "at": [1, *desc["at"][1:]]}],
            "bad_length": [{**desc, "tensors": [{**desc["tensors"][0], "nbytes": 1 << 20}, *desc["tensors"][1:]]}],
            "bad_checksum": [{**desc, "tensors": [{**desc["tensors"][0], "xxh": 1}, *desc["tensors"][1:]]}],
            "shm_missing": [{**desc, "seg": desc["seg"][:-1] + "9"}],
        }
        with pytest.raises(shm.ShmError, match="too_big"):  # more than a message may carry: refused before mapping
            shm_reader.Reader(run, True, bound=100).views(desc)
        for reason, descs in cases.items():
            for bad in descs:
                with pytest.raises(shm.ProtocolError) as exc:
                    r.views(bad)
                assert exc.value.reason == reason, (bad, exc.value)
        # a file of our run's pattern that is not a segment of ours: another mode, or a link to something else
        loose = shm.ROOT / desc["seg"].replace("-worker-", "-shard1-")
        loose.write_bytes(bytes(4096))
        loose.chmod(0o644)
        with pytest.raises(shm.ShmError, match="shm_not_ours"):
            r.views({**desc, "seg": loose.name})
        loose.unlink()
        (tmp_path / "target").write_bytes(bytes(4096))
        loose.symlink_to(tmp_path / "target")
        with pytest.raises(shm.ShmError, match="shm_missing"):  # O_NOFOLLOW: a link is never opened
            r.views({**desc, "seg": loose.name})
        loose.unlink()
        assert torch.equal(r.copied(desc)["w"], tensors()["w"])  # and the good one still reads
    finally:
        other.close()


WRITER = """
import os, sys, torch
from cmemi.shared.memory import shm
w = shm.Writer(sys.argv[1], "worker", False)
w.write({"w": torch.ones(1000)})
slot, views = w.begin([{"name": "w", "dtype": "float32", "shape": [1000], "nbytes": 4000}])
views[0].fill_(7.0)  # half of a new version written, then SIGKILLed before the commit
print(w.path.name, flush=True)
sys.stdin.read()
"""


def test_a_sigkilled_writer_leaves_no_usable_slot_and_is_swept(run: str) -> None:
    with subprocess.Popen([sys.executable, "-c", WRITER, run], cwd=ROOT, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            name = proc.stdout.readline().strip()
            assert (shm.ROOT / name).exists()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    r = shm_reader.Reader(run, False)
    # the slot being written when it died: its sequence is odd, no descriptor of it can be made to pass
    torn = {"seg": name, "slot": 1, "seq": 2, "at": [0], "tensors": [{"name": "w", "dtype": "float32",
                                                                      "shape": [1000], "nbytes": 4000, "xxh": None}]}
    with pytest.raises(shm.ShmError, match="shm_overwritten"):
        r.views(torn)
    assert torch.equal(r.copied({**torn, "slot": 0})["w"], torch.ones(1000))  # the last whole version still reads
    mine = shm.Writer(f"{run}-next", "leader", False)
    mine.write({"x": torch.ones(1)})  # the next segment made sweeps the dead writer's, of any run (one killed whole)
    poll(lambda: shm.owned(run) == [], 10, "the dead writer's segment swept")
    assert [p.name for p in shm.owned(f"{run}-next")] == [mine.path.name]  # a live owner's stays
    mine.close()
    assert shm.owned(f"{run}-next") == []


def test_descriptors_are_bounded_by_the_maps_and_go_with_them(run: str) -> None:
    def shm_fds() -> int:  # CPython's mmap keeps a duplicate of its file's descriptor: one per live map
        mine = f"/dev/shm/cmemi-{shm.run_tag(run)}-"
        return sum(os.readlink(f"/proc/self/fd/{fd}").startswith(mine) for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    w, r = shm.Writer(run, "worker", False), shm_reader.Reader(run, False, limit=2)
    for i in range(6):  # six segments (a bigger one each time), each read
        r.copied(w.write({"x": torch.ones(1000 * 4 ** i)}))
    assert len(r.maps) == 2  # at most `limit` maps: a replaced segment's pages go with its last map
    assert shm_fds() <= 2 + 2  # the writer's segment and the one it replaced, the reader's two maps
    assert len(shm.owned(run)) == 2
    w.close()
    r.maps.clear()  # the last reference to each map: closed now, with its descriptor
    assert shm_fds() == 0 and shm.owned(run) == []


def test_slots_only_for_small_models_on_a_tmpfs_with_room(monkeypatch) -> None:
    """Big models keep frames (a slot is a second copy on each side); so does any model when /dev/shm could not hold
    every segment (a full tmpfs kills the writer of a mapping with SIGBUS)."""
    def room(mib: int) -> None:  # /dev/shm's free space, as statvfs reports it
        monkeypatch.setattr(shm.os, "statvfs", lambda _p: SimpleNamespace(f_bavail=mib, f_frsize=1 << 20))

    # each bound on its own: with room to spare only the model's size refuses (a small /dev/shm, a container's
    # 64 MB, would refuse a model over MAX_MODEL_BYTES anyway and hide the size bound) ...
    room(1 << 20)  # 1 TiB
    assert shm.suits(21 << 20, 2) and shm.suits(shm.MAX_MODEL_BYTES, 2) and not shm.suits(shm.MAX_MODEL_BYTES + 1, 2)
    # ... and for models well under MAX_MODEL_BYTES only the room refuses
    room(100)  # 100 MiB
    assert shm.suits(16 << 20, 2) and not shm.suits(21 << 20, 2)  # 6 × 21 MiB do not fit
