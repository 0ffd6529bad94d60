"""A step's inputs copied for its step log entry (link.py), where the copy costs least: into a shared-memory slot of
this server's when the checkpointer is on this host, else into buffers kept from step to step.

The copy is needed anyway (the optimizer step changes the gradient in place, the next step's sums reuse its memory),
so the slot costs nothing more than the copy did, and the entry's message carries only the slot's descriptor: the
checkpointer copies it into its log before it acknowledges, and the next entry is staged only after that ack, so
the slot is never rewritten while it is read. Over tcp:// the kept buffers are sent zero-copy by the same rule. A
fresh copy each step (`clone`) also faulted in a new 2.4 MB of pages per step for bench/recovery.py's model (issue 47).

One slot of the segment's two is written (`shm.Writer(slots=1)`): an entry is staged only once the one before is
acknowledged, so a second slot bought no overlap, and written in turn both were resident, a slice of this server's
memory each (issue 47: bench/memory.py's leader was over issue 34's budget by about that slice).

A shard k > 0 keeps its entries until they are acknowledged and sends them again when late (steplog/shard.py), so
its entries in the slot (`keep`) are tracked until `free`d by their `logged`: the slot is written again only once
what it held is acknowledged (`can_keep`; the shard's next step is not guaranteed it, only the step's before: link.py
`keep_wait_s` says how long it is waited for), so a kept entry's descriptor stays readable until its ack.
"""

from __future__ import annotations

from typing import Any

import torch
from cmemi.shared.memory import shm
from cmemi.shared.wire import protocol


def kept_copy(kept: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` copied into `kept[name]` (made, or made again when its shape or dtype changed): a buffer reused from step
    to step, whose pages are not faulted in again for every copy."""
    buf = kept.get(name)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = kept[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
    return buf.copy_(t)


class Staging:
    """One server's copies of its entries: `copy` stages one, `descriptor` names the slot it is in (same host)."""

    def __init__(self, run: str, shard: int, checksum: bool) -> None:
        self.run, self.role, self.checksum = run, f"log{shard}", shm.checksums(checksum)
        self.slots: shm.Writer | None = None  # made at the first same-host entry
        self.desc: dict[str, Any] | None = None  # the slot the last staged entry is in (None: not in a slot)
        self.kept: dict[str, torch.Tensor] = {}
        self.held: dict[int, tuple[str, int]] = {}  # a shard's kept entries not acknowledged: step -> (segment, slot)
        self.sig: list[tuple[str, torch.dtype, torch.Size]] = []  # the names, dtypes and shapes `metas` describe
        self.metas: list[dict[str, Any]] = []

    def _writer(self) -> shm.Writer:
        if self.slots is None:
            self.slots = shm.Writer(self.run, self.role, self.checksum, slots=1)
        return self.slots

    def copy(self, src: dict[str, torch.Tensor], local: bool) -> dict[str, torch.Tensor]:
        """`src` copied: into the next slot (`local`: the checkpointer is on this host), else into the kept buffers."""
        self.desc = None
        if not local:
            return {n: kept_copy(self.kept, n, t) for n, t in src.items()}
        if (sig := [(n, t.dtype, t.shape) for n, t in src.items()]) != self.sig:  # (the entries' metas: made once)
            self.sig, self.metas = sig, [{"name": n, "dtype": protocol.DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                                          "nbytes": t.numel() * t.element_size(), "xxh": None} for n, t in src.items()]
        metas = self.metas
        writer = self._writer()
        slot, views = writer.begin(metas)
        if len(views) != len(src):
            raise ValueError(f"{len(views)} slot views for {len(src)} tensors")
        if views:  # one call, not a dispatch per tensor (issue 45); none for an empty entry (a skipped step)
            torch._foreach_copy_(views, list(src.values()))
        self.desc = writer.commit(slot, metas, views)
        return dict(zip(src, views, strict=True))

    def can_keep(self) -> bool:
        """Can `keep` stage an entry without overwriting one not acknowledged yet (the one slot's)?"""
        return not self.held

    def keep(self, step: int, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`src` copied into the next slot for step `step`'s kept entry (`can_keep` first); held until `free`."""
        views = self.copy(src, True)
        assert self.desc is not None
        self.held[step] = (self.desc["seg"], self.desc["slot"])
        return views

    def free(self, step: int) -> bool:
        """Step `step`'s entry is acknowledged: its slot may be written again. True if it was in one."""
        return self.held.pop(step, None) is not None

    def forget_before(self, step: int) -> None:
        """No longer wait for the acks of entries before `step` (steplog/shard.py keeps none of them any more)."""
        for s in [s for s in self.held if s < step]:
            del self.held[s]

    def unstaged(self) -> None:
        """The entry about to be sent was not staged here (`ship` of tensors as they lie)."""
        self.desc = None

    def descriptor(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The slot descriptor of the staged entry, whose tensors are `tensors`; written into a slot now if they are
        not in one (staged for a checkpointer elsewhere, which restarted on this host)."""
        if self.desc is None:
            self.desc = self._writer().write(tensors)
        return self.desc

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
