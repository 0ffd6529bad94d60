"""A same-host entry with the spool on goes into the log's segment straight from the server's slot, a chunk at a time
(services/checkpointer/steplog.py `Streamed`, `LogFiles.append_from`; issue 47): the checkpointer holds none of it —
at most a chunk of the slot is mapped here at once, measured in this process's own page tables — the record reads
back bitwise after a restart, and a slot whose bytes fail their checksum, or that was written meanwhile, leaves no
record and nothing held."""

from __future__ import annotations

import mmap
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cmemi.services.checkpointer.logfiles import LogFiles, Stored
from cmemi.services.checkpointer.steplog import StepLog, Streamed
from cmemi.shared.memory import shm, shm_reader

from tests.test_steplog_units import spill_to

CHUNK = 4 << 20
PAGES = 2 * mmap.PAGESIZE + (128 << 10)  # a chunk's ends rounded out to pages; a read fault maps up to 64 KiB around it


def full(exc: OSError, attempt: int) -> None:
    raise AssertionError(f"no disk-full expected: {exc} (attempt {attempt})")


def mapped_bytes(segment: str) -> int:
    """The bytes of `segment` resident in this process's page tables (its maps' Rss in /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and all(c in "0123456789abcdef-" for c in first):
            inside = segment in line
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def in_slot(tensors: dict[str, torch.Tensor], checksum: bool = False
            ) -> tuple[shm_reader.Reader, dict, memoryview]:
    """`tensors` written into a server's one slot, the writer gone (its map closed: only the reader's is left here),
    and the checkpointer's reader's view of the slot's bytes."""
    run = f"streamed-{uuid.uuid4().hex}"
    writer = shm.Writer(run, "log0", checksum, slots=1)
    desc = writer.write(tensors)
    reader = shm_reader.Reader(run, checksum)
    data = reader.slot(desc)
    writer.close()
    return reader, desc, data


def streamed(reader: shm_reader.Reader, desc: dict, data: memoryview,
             seen: list[int] | None = None, intact: Callable[[], bool] | None = None) -> Streamed:
    def unmap(lo: int, hi: int) -> None:
        if seen is not None:
            seen.append(mapped_bytes(desc["seg"]))  # (the chunk just written still mapped: the most it holds)
        reader.unmap(desc, lo, hi)

    return Streamed(desc["tensors"], desc["at"], data, CHUNK, unmap, intact or (lambda: reader.intact(desc)))


def test_a_same_host_entry_goes_to_the_segment_from_the_slot_with_at_most_a_chunk_mapped(tmp_path: Path) -> None:
    """The one-line change that fails this: steplog.py `Streamed.chunks` without its `self.unmap(lo, hi)` (the slot
    read through and left mapped: 32 MB resident here, as the landing did with a buffer as big again)."""
    src = {"g.w": torch.randn(8 << 20), "g.b": torch.arange(5, dtype=torch.float64), "g.e": torch.empty(0)}
    reader, desc, data = in_slot(src)
    assert mapped_bytes(desc["seg"]) <= PAGES  # (the sequence number's page, read by `slot`, and its neighbours)
    log = StepLog(0, 1 << 40, spill_to(tmp_path / "spill"), LogFiles(tmp_path / "segments", full))
    seen: list[int] = []
    assert log.add(0, {"step": 1, "skip": False}, streamed(reader, desc, data, seen))
    assert mapped_bytes(desc["seg"]) <= PAGES, mapped_bytes(desc["seg"])  # (the slot read through, none of it kept)
    assert len(seen) == 9 and max(seen) <= CHUNK + PAGES, seen  # 32 MB + 40 B in 4 MiB chunks, one mapped at a time
    entry = log.entry(0, 1)
    assert entry is not None and log.in_memory == 0 and all(isinstance(t, Stored) for t in entry.tensors.values())
    assert all(torch.equal(entry.loaded()[n], t) and entry.loaded()[n].dtype == t.dtype for n, t in src.items())
    back = StepLog(0, 1 << 40, spill_to(tmp_path / "spill2"), LogFiles(tmp_path / "segments", full))
    assert back.recover()["entries"] == 1 and back.recover()["lost"] == 0
    again = back.entry(0, 1)
    assert again is not None and all(torch.equal(again.loaded()[n], t) for n, t in src.items())


@pytest.mark.parametrize("fault", ["checksum", "overwritten"])
def test_a_slot_that_is_not_what_the_server_wrote_leaves_no_record_and_nothing_held(tmp_path: Path,
                                                                                   fault: str) -> None:
    """The one-line change that fails this: logfiles.py `append_from` without `source.finish()` (the record written
    whole, and the entry held, from bytes the server never sent)."""
    src = {"g.w": torch.randn(3 << 20), "g.b": torch.ones(7)}
    reader, desc, data = in_slot(src, checksum=True)
    assert all(isinstance(m["xxh"], int) for m in desc["tensors"])
    if fault == "checksum":
        desc = {**desc, "tensors": [{**m, "xxh": m["xxh"] ^ 1} if m["name"] == "g.w" else m for m in desc["tensors"]]}
    files = LogFiles(tmp_path / "segments", full)
    log = StepLog(0, 1 << 40, spill_to(tmp_path / "spill"), files)
    with pytest.raises(shm.ShmError) as err:
        log.add(0, {"step": 1, "skip": False}, streamed(reader, desc, data,
                                                        intact=(lambda: False) if fault == "overwritten" else None))
    assert err.value.reason == ("bad_checksum" if fault == "checksum" else "shm_overwritten")
    assert log.entry(0, 1) is None and files.segments[-1].end == 0
    assert files.segments[-1].path.stat().st_size == 0  # cut: nothing of it for a restart to read back
    good = in_slot(src)
    assert log.add(0, {"step": 1, "skip": False}, streamed(*good))  # the server's resend is held: no gap
    entry = log.entry(0, 1)
    assert entry is not None and torch.equal(entry.loaded()["g.w"], src["g.w"])
