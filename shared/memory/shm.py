"""Shared-memory slots: tensors that same-host peers hand over in place, with only a descriptor on the socket.

A producer (a server publishing a parameter version, a worker sending a gradient) owns one segment, a file under
/dev/shm of mode 0600 named `cmemi-<run>-<role>-<pid>-<n>` (`<run>`: a hash of the run id), mapped once and
reused. It holds two slots (a double buffer: a slow reader of one version is not overwritten by the next), each a
64-byte header — the slot's sequence number — and the tensors, each at a multiple of 64 bytes. The producer
(`Writer`) makes the sequence odd, writes the tensors, makes it even again (a seqlock), and sends the descriptor:

    {"seg": name, "slot": 0 or 1, "seq": n (even), "at": [byte offset of each tensor], "tensors": [entries]}

with the entries of `protocol.encode_tensors` (dtype, shape, nbytes, and the xxh3 when cluster.checksum is on).
The consumer (`Reader`, shm_reader.py) maps the segment once (cached by name), checks the sequence is the descriptor's before it
reads, takes the tensors as views of the slot (checksums verified), copies them where they belong, and checks the
sequence again after (`intact`): a slot rewritten meanwhile (its writer is two messages ahead, or was SIGKILLed
mid-write and its slot reused by a successor's segment of another name) is never used — the consumer drops what
it copied and asks again, as for a lost message. A descriptor is validated before anything is mapped: the name's
pattern and run, the file (a regular file of our uid, mode 0600, not a link), each tensor inside its slot;
anything wrong raises `ShmError` with a drop reason.

Segments are unlinked when their owner closes them or exits (atexit); a SIGKILLed owner's are removed by the next
process that creates one, and by each server at its start (`sweep`: the owner pid in the name is dead).

The sequence store after the tensors' stores, and the reader's loads in the opposite order, rely on stores becoming
visible in order and loads not passing earlier loads: x86-64's memory model (TSO). There the seqlock alone makes a
torn slot unusable, and xxh3 checksums would add nothing but four passes over the bytes (measured: ~15% of a
comm-bound step), so slots carry them only on other machines, and only with cluster.checksum (`checksums`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import mmap
import os
import platform
import re
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash
from cmemi.shared.runtime.exits import at_exit
from cmemi.shared.wire import protocol
from cmemi.shared.wire.protocol import ProtocolError
from cmemi.shared.wire.samehost import alive  # the same liveness rule as the ipc:// socket files

ROOT = Path("/dev/shm")
ALIGN = 64
HEAD = 64  # bytes before each slot's tensors: the sequence number (u64, little-endian)
SLOTS = 2
SEQ = struct.Struct("<Q")
_MADE = itertools.count()  # segments this process made: their names' last field, unique per process
NAME = re.compile(r"cmemi-([0-9a-f]{12})-([a-z0-9]{1,16})-([0-9]{1,10})-([0-9]{1,10})")


ORDERED = platform.machine() in ("x86_64", "AMD64")  # TSO: see the module's docstring


def checksums(configured: bool) -> bool:
    """Do slots carry xxh3 checksums (cluster.checksum, and a weaker memory order than x86-64's)?"""
    return configured and not ORDERED


class ShmError(ProtocolError):
    """A descriptor or a segment that must not be used (its `reason` is the drop label)."""


# Slots for models of at most this many parameter bytes. A slot is a second copy of what it carries on each side
# (the writer's segment, double-buffered, and the reader's mapping of it): for a small model the copies through
# the socket are the cost and the memory is nothing; for a big one the copies are a small part of a step and the
# memory is what limits it (issue 34's budgets), so it keeps frames over ipc:// (docs/design.md §8).
# No lower bound: a small model's step costs no more through slots than over ipc://. bench/slot_path.py (CPU time per
# call, one process, flat float32 models; 2 cores at load 9-13) gives, for a worker's step (its gradient up, a version
# down), slot / socket of 0.98-1.03 at 1 KiB (82-99 µs either way), 0.89-0.93 at 4 KiB, 0.86-0.94 at 18 KiB
# (bench/small.py's cnn1d) and 0.56-0.70 at 64 KiB: a gradient alone costs 1.0-1.3x its socket's below 64 KiB (the
# descriptor's message is most of a small one), a version 0.7-0.9x (the worker computes on it in place). Before a
# slot's layout was kept (shm_reader.Segment, Writer.laid) the same step cost 1.62x its socket's at 1 and 18 KiB
# and 1.08x at 64 KiB: issue 45's small-step floor.
MAX_MODEL_BYTES = 64 << 20


def payload_bytes(desc: dict[str, Any]) -> int:
    """The tensor bytes a descriptor of ours names: what moved through the slot (counted as the socket's would be)."""
    return sum(int(m["nbytes"]) for m in desc["tensors"])


def available() -> bool:
    """Can this process make segments (a writable /dev/shm)?"""
    return ROOT.is_dir() and os.access(ROOT, os.W_OK | os.X_OK)


def suits(model_bytes: int, workers: int) -> bool:
    """Does a model of `model_bytes` parameter bytes travel in slots (MAX_MODEL_BYTES), on a host that has them with
    room for every segment of `workers` workers and their servers (two slots of the model each)? A tmpfs that fills
    up under a mapping kills its writer with SIGBUS (a container's /dev/shm is 64 MB by default): frames instead."""
    if model_bytes > MAX_MODEL_BYTES or not available():
        return False
    try:
        st = os.statvfs(ROOT)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * (workers + 1) * model_bytes


def run_tag(run: str) -> str:
    return hashlib.sha256(run.encode()).hexdigest()[:12]


def owned(run: str) -> list[Path]:
    """This run's segments, whoever owns them."""
    prefix = f"cmemi-{run_tag(run)}-"
    try:
        return [ROOT / n for n in os.listdir(ROOT) if n.startswith(prefix)]
    except OSError:
        return []


def sweep() -> int:
    """Remove our uid's segments whose owner is dead (SIGKILLed: nobody unlinked them), of this run or of an earlier
    one killed whole; returns how many. A map of one stays valid; a reader that had not mapped it drops its
    descriptor (`shm_missing`), as it would drop anything else from a dead peer."""
    removed = 0
    try:
        names = os.listdir(ROOT)
    except OSError:
        return 0
    for name in names:
        m = NAME.fullmatch(name)
        if m is None or alive(int(m.group(3))):
            continue
        path = ROOT / name
        with contextlib.suppress(OSError):
            if path.lstat().st_uid == os.getuid():
                path.unlink()
                removed += 1
    return removed


def _place(metas: list[dict[str, Any]]) -> tuple[list[int], int]:
    """Each tensor's byte offset in a slot (multiples of ALIGN), and the bytes the slot needs."""
    at, end = [], 0
    for m in metas:
        at.append(end)
        end += (m["nbytes"] + ALIGN - 1) // ALIGN * ALIGN
    return at, end


def slot_bytes(mm: mmap.mmap, start: int, nbytes: int) -> torch.Tensor:
    """The `nbytes` of a slot's tensors as one byte tensor on the map: every tensor is a view of it (`tensor_at`),
    so a run of adjacent ones can be viewed as one (services/worker/links/inbox.py)."""
    with warnings.catch_warnings():  # a reader's map is read-only on purpose: torch warns that it is
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=start)


def tensor_at(slot: torch.Tensor, at: int, dtype: torch.dtype, shape: list[int], nbytes: int) -> torch.Tensor:
    return slot[at:at + nbytes].view(dtype).view(shape)


class Writer:
    """One producer's segment: `write` puts tensors in the next slot and returns their descriptor."""

    def __init__(self, run: str, role: str, checksum: bool, slots: int = SLOTS) -> None:
        """`slots`: how many of the segment's slots are written in turn (1: always the first, for a writer that writes
        again only once what it wrote was read, so the second slot's pages are never touched: the step log)."""
        if not re.fullmatch(r"[a-z0-9]{1,16}", role):
            raise ValueError(f"segment role {role!r} must be 1-16 lowercase letters or digits")
        if not 1 <= slots <= SLOTS:
            raise ValueError(f"slots must be 1..{SLOTS}, not {slots}")
        self.run, self.role, self.checksum, self.slots = run, role, checksum, slots
        self.path: Path | None = None
        self.mm: mmap.mmap | None = None
        self.capacity = 0  # bytes per slot, header excluded
        self.swept = False
        self.retired: tuple[Path | None, mmap.mmap | None] = (None, None)  # the segment a bigger one replaced
        self.seqs = [0] * SLOTS
        self.next = 0
        # what a layout costs, paid once per (slot, layout) of this segment (shm_reader.py says why): each slot's bytes
        # as one tensor, the tensors' offsets and their views; the last `begin`'s offsets per slot, for `commit`
        self.wholes: list[torch.Tensor] = []
        self.laid: dict[tuple[int, tuple[tuple[str, tuple[int, ...], int], ...]], tuple[list[int], list[torch.Tensor]]] = {}
        self.opened: list[list[int]] = [[] for _ in range(SLOTS)]
        at_exit(self.close)

    def _grow(self, need: int) -> None:
        # the segment it replaces stays linked until the next one replaces this one: a descriptor of it may still be
        # on its way to a reader that has not mapped it yet
        replaced = (self.path, self.mm)
        self.path, self.mm = self.retired
        self._drop()
        self.retired, self.path, self.mm = replaced, None, None
        if not self.swept:
            sweep()
            self.swept = True
        capacity = max(ALIGN, need, self.capacity * 3 // 2)  # a bigger one later replaces it under a new name
        path = ROOT / f"cmemi-{run_tag(self.run)}-{self.role}-{os.getpid()}-{next(_MADE)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, SLOTS * (HEAD + capacity))
            self.mm = mmap.mmap(fd, SLOTS * (HEAD + capacity))
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        os.close(fd)  # the map holds a duplicate of its own (CPython's mmap), closed with the map
        self.path, self.capacity, self.seqs, self.next = path, capacity, [0] * SLOTS, 0
        self.wholes = [slot_bytes(self.mm, s * (HEAD + capacity) + HEAD, capacity) for s in range(SLOTS)]

    def begin(self, metas: list[dict[str, Any]]) -> tuple[int, list[torch.Tensor]]:
        """Open the next slot for writing tensors of `metas` (name, dtype, shape, nbytes): (slot, one view each).
        Its sequence is odd until `commit`."""
        slot = self.next
        key = (slot, tuple((m["dtype"], tuple(m["shape"]), m["nbytes"]) for m in metas))
        laid = self.laid.get(key)
        if laid is None:
            at, need = _place(metas)
            if self.mm is None or need > self.capacity:
                self._grow(need)  # (forgets every layout: they were views of the replaced segment)
            laid = at, [tensor_at(self.wholes[slot], a, protocol.DTYPES[m["dtype"]], m["shape"], m["nbytes"])
                        for m, a in zip(metas, at, strict=True)]
            if len(self.laid) >= 2 * SLOTS:  # an honest writer has one layout or two
                self.laid.clear()
            self.laid[key] = laid
        assert self.mm is not None
        self.seqs[slot] += 1
        SEQ.pack_into(self.mm, slot * (HEAD + self.capacity), self.seqs[slot])
        self.opened[slot] = laid[0]
        return slot, list(laid[1])

    def commit(self, slot: int, metas: list[dict[str, Any]], views: list[torch.Tensor]) -> dict[str, Any]:
        """The slot is written: its sequence even again, and its descriptor (checksums computed here)."""
        assert self.mm is not None and self.path is not None and self.seqs[slot] % 2 == 1
        if self.checksum:
            metas = [{**m, "xxh": xxhash.xxh3_64_intdigest(protocol.tensor_bytes(v)) if v.numel() else
                      xxhash.xxh3_64_intdigest(b"")} for m, v in zip(metas, views, strict=True)]
        else:
            metas = [{**m, "xxh": None} for m in metas]
        self.seqs[slot] += 1
        SEQ.pack_into(self.mm, slot * (HEAD + self.capacity), self.seqs[slot])
        self.next = (slot + 1) % self.slots
        return {"seg": self.path.name, "slot": slot, "seq": self.seqs[slot], "at": list(self.opened[slot]),
                "tensors": metas}

    def write(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Copy `tensors` into the next slot; their descriptor."""
        metas = [{"name": n, "dtype": protocol.DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                  "nbytes": t.numel() * t.element_size(), "xxh": None} for n, t in tensors.items()]
        slot, views = self.begin(metas)
        for v, t in zip(views, tensors.values(), strict=True):
            v.copy_(t.detach())  # (not under torch.no_grad(): entering it costs as much as copying a small gradient)
        return self.commit(slot, metas, views)

    def close(self) -> None:
        """Unlink the segment (and a replaced one); its pages go once no view of them is left (here or in a reader)."""
        self._drop()
        path, self.mm = self.retired
        self.path, self.retired = path, (None, None)
        self._drop()

    def _drop(self) -> None:
        self.wholes, self.laid = [], {}  # views of the map: it can close only once none is left
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.path = None
        if self.mm is not None:
            with contextlib.suppress(BufferError):  # views still alive: the map goes with the last of them
                self.mm.close()
            self.mm = None
