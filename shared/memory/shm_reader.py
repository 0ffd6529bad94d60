"""The consumer's side of shared-memory slots (shm.py lays them out and writes them): map a peer's segment once,
check its descriptor before anything is mapped, read the tensors as views of the slot and check afterwards that
nothing rewrote the slot meanwhile (`intact`), the seqlock that makes a torn slot unusable.

A peer writes the same tensors (its model's flat frames, its gradient's) into the same two slots step after step, so
what a descriptor's layout costs is paid once per (segment, slot, layout), not per read (`Segment`): the slot's bytes
as one tensor (a `torch.frombuffer` under a warnings filter), each tensor entry's dtype, shape and bounds checked, and
the views made. Rebuilt on every read they cost a small model's leader more per step than decoding its gradient off a
socket did (issue 45's small-step floor): `bench/slot_path.py` times a read of an 18 KiB slot at 12 µs of CPU rebuilt,
4 µs kept (2 cores, busy). What a descriptor says that can change from read to read — its sequence number and
checksums — is checked on every read."""

from __future__ import annotations

import mmap
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch
import xxhash
from cmemi.shared.memory import shm
from cmemi.shared.memory.shm import ALIGN, HEAD, NAME, SEQ, SLOTS, ShmError, run_tag, slot_bytes, tensor_at
from cmemi.shared.wire import protocol

LAYOUTS = 8  # views kept per segment: both slots of a few layouts (an honest peer sends one or two)
Key = tuple[int, tuple[int, ...], tuple[tuple[str, str, tuple[int, ...], int], ...]]  # slot, offsets, entries


def _int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _plain(slot: Any, seq: Any, at: Any, metas: Any) -> bool:
    """A descriptor's fields of exactly the types msgpack decodes them as (what every honest one is): the checks of
    `_fields` in one pass of `type(...) is` tests. Made for every slot read (the leader reads two a step of a small
    model, each worker one, the checkpointer one), `_fields` alone cost 7.3 us of CPU a read of 8 tensor entries,
    this 3.7 (thread_time, a 2-core machine): issue 45's small-step floor. False sends it to `_fields`, which names
    what is wrong (or accepts what only an `isinstance` accepts, as it always did)."""
    return (type(slot) is int and 0 <= slot < SLOTS and type(seq) is int and seq > 0 and seq % 2 == 0
            and type(at) is list and type(metas) is list and len(at) == len(metas)
            and all(type(a) is int and a >= 0 for a in at)
            and all(type(x) is dict and type(x.get("name")) is str and type(x.get("dtype")) is str
                    and type(x.get("shape")) is list and type(x.get("nbytes")) is int
                    and (x.get("xxh") is None or type(x.get("xxh")) is int) for x in metas))


def _fields(slot: Any, seq: Any, at: Any, metas: Any) -> None:
    """The descriptor's slot, sequence number, offsets and tensor entries are of their types (ShmError names which)."""
    if not (_int(slot) and 0 <= slot < SLOTS and _int(seq) and seq > 0 and seq % 2 == 0
            and isinstance(at, list) and isinstance(metas, list) and len(at) == len(metas)
            and all(_int(a) and a >= 0 for a in at) and all(isinstance(x, dict) for x in metas)):
        raise ShmError("shm_bad", "slot, seq, at or tensors")
    for x in metas:
        for key, types in (("name", str), ("dtype", str), ("shape", list), ("nbytes", int)):
            if not isinstance(x.get(key), types) or isinstance(x.get(key), bool):
                raise ShmError("shm_bad", f"tensor entry field {key!r}")
        if x.get("xxh") is not None and not _int(x["xxh"]):
            raise ShmError("shm_bad", "tensor entry field 'xxh'")


@dataclass(eq=False)
class Segment:
    """A peer's segment as this reader maps it: the map, each slot's bytes as one tensor (made on the slot's first
    read), and the views of each (slot, layout) read before, checked when they were made. Everything here goes with the
    entry (the map is closed once no view of it is left)."""

    mm: mmap.mmap
    capacity: int  # bytes per slot, header excluded
    slots: list[torch.Tensor | None] = field(default_factory=lambda: [None] * SLOTS)
    views: dict[Key, dict[str, torch.Tensor]] = field(default_factory=dict)

    def whole(self, slot: int) -> torch.Tensor:
        t = self.slots[slot]
        if t is None:
            t = self.slots[slot] = slot_bytes(self.mm, slot * (HEAD + self.capacity) + HEAD, self.capacity)
        return t

    def seq(self, slot: int) -> int:
        return int(SEQ.unpack_from(self.mm, slot * (HEAD + self.capacity))[0])


def layout_key(slot: int, at: list[int], metas: list[dict[str, Any]]) -> Key | None:
    """What a descriptor's views depend on, as a key of `Segment.views`; None where a shape holds anything but ints
    (`tensor_spec` refuses it: 1.0 or True would hash as 1 and find the views checked for a valid entry)."""
    if not all(type(d) is int for x in metas for d in x["shape"]):
        return None
    return slot, tuple(at), tuple((x["name"], x["dtype"], tuple(x["shape"]), x["nbytes"]) for x in metas)


class Reader:
    """A consumer's maps of its peers' segments (at most `limit`, least recently used dropped first)."""

    def __init__(self, run: str, checksum: bool, limit: int = 16, bound: int | None = None) -> None:
        # bound: the most bytes one descriptor may name (limits.logical_bytes, as for a message in parts)
        self.tag, self.checksum, self.limit, self.bound = run_tag(run), checksum, limit, bound
        self.maps: OrderedDict[str, Segment] = OrderedDict()

    def _map(self, name: str) -> Segment:
        seg = self.maps.get(name)
        if seg is not None:
            self.maps.move_to_end(name)
            return seg
        try:
            fd = os.open(shm.ROOT / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmError("shm_missing", f"{name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ShmError("shm_not_ours", f"{name}: not a regular file of mode 0600 owned by uid {os.getuid()}")
            if st.st_size < SLOTS * (HEAD + ALIGN) or st.st_size % SLOTS:
                raise ShmError("shm_bad_size", f"{name}: {st.st_size} bytes")
            mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        for old in [n for n in self.maps if not (shm.ROOT / n).exists()]:  # unlinked: replaced, or its owner is gone
            del self.maps[old]  # its pages go with the last view of them
        self.maps[name] = seg = Segment(mm, len(mm) // SLOTS - HEAD)
        while len(self.maps) > self.limit:  # the least recently used
            self.maps.popitem(last=False)
        return seg

    def _check(self, desc: Any) -> tuple[Segment, int, list[dict[str, Any]], list[int]]:
        """The checks that need nothing mapped, then the map (segment, slot, tensor entries, offsets)."""
        if not isinstance(desc, dict):
            raise ShmError("shm_bad", "the descriptor is not a map")
        fields: list[Any] = [desc.get(k) for k in ("seg", "slot", "seq", "at", "tensors")]  # (typed by the checks)
        name, slot, seq, at, metas = fields
        if not isinstance(name, str) or (name not in self.maps  # (a mapped name was checked when it was mapped)
                                     and ((m := NAME.fullmatch(name)) is None or m.group(1) != self.tag)):
            raise ShmError("shm_bad", f"segment name {str(name)[:60]!r}")
        if not _plain(slot, seq, at, metas):
            _fields(slot, seq, at, metas)
        if self.bound is not None and (total := sum(x["nbytes"] for x in metas)) > self.bound:
            raise ShmError("too_big", f"a slot of {total} bytes, bound {self.bound}")
        return self._map(name), slot, metas, at

    @staticmethod
    def _sliced(seg: Segment, slot: int, metas: list[dict[str, Any]], at: list[int]) -> dict[str, torch.Tensor]:
        """Each entry checked (dtype, shape and length agree, inside the slot) and viewed in the slot."""
        for x, a in zip(metas, at, strict=True):
            protocol.tensor_spec(x)  # dtype, shape, nbytes agree (ProtocolError)
            if a % ALIGN or a + x["nbytes"] > seg.capacity:
                raise ShmError("shm_bounds", f"{x['name']!r}: [{a}, {a + x['nbytes']}) in a slot of {seg.capacity}"[:80])
        whole = seg.whole(slot)
        return {x["name"]: tensor_at(whole, a, *protocol.tensor_spec(x)) for x, a in zip(metas, at, strict=True)}

    def views(self, desc: Any) -> dict[str, torch.Tensor]:
        """The tensors a descriptor names, as read-only views of its slot (checksums verified). Copy them, then
        check `intact(desc)` before using the copy. The dict is the caller's; the views are shared with later reads of
        the same slot and layout (read-only: nothing may write or reshape them)."""
        seg, slot, metas, at = self._check(desc)
        views = self._viewed(desc, seg, slot, metas, at)
        if self.checksum:
            for x in metas:
                v = views[x["name"]]
                if x["xxh"] is not None and xxhash.xxh3_64_intdigest(
                        protocol.tensor_bytes(v) if v.numel() else b"") != x["xxh"]:
                    raise ShmError("bad_checksum", repr(x["name"])[:60])
        return dict(views)

    def slot(self, desc: Any) -> memoryview:
        """The bytes of a descriptor's slot (read-only; its tensors at `desc["at"]`), every entry checked as `views`
        checks it but no checksum read: a caller that reads the bytes a piece at a time (`unmap` after each) checks
        each tensor's `xxh` itself, then `intact`."""
        seg, slot, metas, at = self._check(desc)
        self._viewed(desc, seg, slot, metas, at)
        return protocol.tensor_bytes(seg.whole(slot))

    def unmap(self, desc: dict[str, Any], start: int, stop: int) -> None:
        """This process's mapping of bytes [start, stop) of the descriptor's slot dropped (MADV_DONTNEED, whole pages
        around them): the bytes stay in the peer's segment, read again from it if touched again, and no longer count
        in this process's resident memory (a slot read through once was otherwise resident here as long as mapped)."""
        seg = self.maps.get(desc["seg"])
        if seg is None or stop <= start:
            return
        base = desc["slot"] * (HEAD + seg.capacity) + HEAD
        lo = (base + start) // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min(len(seg.mm), -(-(base + stop) // mmap.PAGESIZE) * mmap.PAGESIZE)
        seg.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _viewed(self, desc: Any, seg: Segment, slot: int, metas: list[dict[str, Any]],
                at: list[int]) -> dict[str, torch.Tensor]:
        """`views` of a checked descriptor (`_check`'s), without the checksums (the views shared, not the caller's)."""
        key = layout_key(slot, at, metas)
        views = seg.views.get(key) if key is not None else None
        if views is None:
            views = self._sliced(seg, slot, metas, at)
            if key is not None:
                if len(seg.views) >= LAYOUTS:
                    seg.views.clear()
                seg.views[key] = views
        if seg.seq(slot) != desc["seq"]:
            raise ShmError("shm_overwritten", f"{desc['seg']} slot {slot}: a newer write, or one unfinished")
        if len(views) != len(metas):
            raise ShmError("bad_tensor", "duplicate tensor names")
        return views

    def intact(self, desc: dict[str, Any]) -> bool:
        """Is the slot still the descriptor's (nothing wrote it since `views`)?"""
        seg = self.maps.get(desc["seg"])
        return seg is not None and seg.seq(desc["slot"]) == desc["seq"]

    def copied(self, desc: Any) -> dict[str, torch.Tensor]:
        """The tensors a descriptor names, copied out of its slot (ShmError when it is torn or overwritten)."""
        views = self.views(desc)
        out = {n: v.clone() for n, v in views.items()}
        del views
        if not self.intact(desc):
            raise ShmError("shm_overwritten", f"{desc['seg']} slot {desc['slot']}: written while read")
        return out
