"""The consumer's side of shared-memory slots (shm.py lays them out and writes them): map a peer's segment once,
check its descriptor before anything is mapped, read the tensors as views of the slot and check afterwards that
nothing rewrote the slot meanwhile (`intact`), the seqlock that makes a torn slot unusable."""

from __future__ import annotations

import mmap
import os
import stat
from collections import OrderedDict
from typing import Any, TypeGuard

import torch
import xxhash
from cmemi.shared.memory import shm
from cmemi.shared.memory.shm import ALIGN, HEAD, NAME, SEQ, SLOTS, ShmError, run_tag, slot_bytes, tensor_at
from cmemi.shared.wire import protocol


def _int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


class Reader:
    """A consumer's maps of its peers' segments (at most `limit`, least recently used dropped first)."""

    def __init__(self, run: str, checksum: bool, limit: int = 16, bound: int | None = None) -> None:
        # bound: the most bytes one descriptor may name (limits.logical_bytes, as for a message in parts)
        self.tag, self.checksum, self.limit, self.bound = run_tag(run), checksum, limit, bound
        self.maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def _map(self, name: str) -> mmap.mmap:
        mm = self.maps.get(name)
        if mm is not None:
            self.maps.move_to_end(name)
            return mm
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
        self.maps[name] = mm
        while len(self.maps) > self.limit:  # the least recently used
            self.maps.popitem(last=False)
        return mm

    def _check(self, desc: Any) -> tuple[mmap.mmap, int, list[dict[str, Any]], list[int]]:
        if not isinstance(desc, dict):
            raise ShmError("shm_bad", "the descriptor is not a map")
        name, slot, seq, at, metas = (desc.get(k) for k in ("seg", "slot", "seq", "at", "tensors"))
        if not isinstance(name, str) or (m := NAME.fullmatch(name)) is None or m.group(1) != self.tag:
            raise ShmError("shm_bad", f"segment name {str(name)[:60]!r}")
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
        if self.bound is not None and (total := sum(x["nbytes"] for x in metas)) > self.bound:
            raise ShmError("too_big", f"a slot of {total} bytes, bound {self.bound}")
        mm = self._map(name)
        capacity = len(mm) // SLOTS - HEAD
        for x, a in zip(metas, at, strict=True):
            protocol.tensor_spec(x)  # dtype, shape, nbytes agree (ProtocolError)
            if a % ALIGN or a + x["nbytes"] > capacity:
                raise ShmError("shm_bounds", f"{x['name']!r}: [{a}, {a + x['nbytes']}) in a slot of {capacity}"[:80])
        return mm, slot * (HEAD + capacity), metas, at

    def views(self, desc: Any) -> dict[str, torch.Tensor]:
        """The tensors a descriptor names, as read-only views of its slot (checksums verified). Copy them, then
        check `intact(desc)` before using the copy."""
        mm, base, metas, at = self._check(desc)
        if SEQ.unpack_from(mm, base)[0] != desc["seq"]:
            raise ShmError("shm_overwritten", f"{desc['seg']} slot {desc['slot']}: a newer write, or one unfinished")
        out: dict[str, torch.Tensor] = {}
        whole = slot_bytes(mm, base + HEAD, len(mm) // SLOTS - HEAD)
        for x, a in zip(metas, at, strict=True):
            dtype, shape, n = protocol.tensor_spec(x)
            v = tensor_at(whole, a, dtype, shape, n)
            if self.checksum and x["xxh"] is not None and xxhash.xxh3_64_intdigest(
                    protocol.tensor_bytes(v) if n else b"") != x["xxh"]:
                raise ShmError("bad_checksum", repr(x["name"])[:60])
            out[x["name"]] = v
        if len(out) != len(metas):
            raise ShmError("bad_tensor", "duplicate tensor names")
        return out

    def intact(self, desc: dict[str, Any]) -> bool:
        """Is the slot still the descriptor's (nothing wrote it since `views`)?"""
        mm = self.maps.get(desc["seg"])
        if mm is None:
            return False
        return bool(SEQ.unpack_from(mm, desc["slot"] * (len(mm) // SLOTS))[0] == desc["seq"])

    def copied(self, desc: Any) -> dict[str, torch.Tensor]:
        """The tensors a descriptor names, copied out of its slot (ShmError when it is torn or overwritten)."""
        views = self.views(desc)
        out = {n: v.clone() for n, v in views.items()}
        del views
        if not self.intact(desc):
            raise ShmError("shm_overwritten", f"{desc['seg']} slot {desc['slot']}: written while read")
        return out
