"""One worker's link to a parameter-server shard k > 0 (shard_links.py keeps them all): what it holds of the pull
being answered, and why a link is given up (`Lost`: the worker says hello again; `Moved`: the shard restarted on
a new address within the term, which the worker links to in place, shard_addrs.py)."""

from __future__ import annotations

from typing import Any

import torch
import zmq
from cmemi.shared.errors import Interrupt
from cmemi.shared.wire import assembly, protocol
from cmemi.shared.wire.layout import Layout


class Lost(Interrupt):
    """A shard did not answer, rejected us, or its parameters do not fit: start over with hello."""


class Moved(Lost):
    """A shard's Redis record names another address than its link's: it restarted there (linked to in place where
    the worker can; elsewhere, as any `Lost`)."""

    def __init__(self, k: int, addr: str) -> None:
        super().__init__(f"shard {k} restarted at {addr}")
        self.k, self.addr = k, addr


def answers(got: protocol.Message | None, version: int) -> bool:
    """Does the slice received answer a pull of `version` (its tensors, or: that version is over)? Not a late answer
    to an earlier pull (that step is over: the current version, no tensors)."""
    return got is not None and (got.header["asked"] == version
                                or (got.header["version"] == version and bool(got.tensors)))


def asking_slots(asks: bool) -> dict[str, Any]:
    """A hello's optional `shm` field (messages.Hello): sent only when it asks for shared-memory slots."""
    return {"shm": True} if asks else {}


class Link:
    def __init__(self, k: int, sock: zmq.Socket, layouts: list[Layout], parts: assembly.Assembler,
                 views: list[dict[str, torch.Tensor]]) -> None:
        self.k, self.sock, self.layouts, self.parts = k, sock, layouts, parts
        self.views = views  # each stage's pieces of the model: where the slice being fetched lands
        # A small model's slice, one stage: in flat buffers of its own, then copied (stages: each message is its
        # own, their flat frames share names).
        self.inbox = layouts[0].empty() if len(layouts) == 1 and layouts[0].flat else None
        self.have = -1  # version whose slice is in the model
        self.asked = -1  # version of the last pull sent
        self.got: list[protocol.Message | None] = [None] * len(layouts)  # each stage's newest slice received
        self.over: protocol.Message | None = None  # the newest answer without tensors (that step is over)
        self.slots = False  # the shard granted shared-memory slots on this connection
        self.addr = ""  # where it is linked to

    def answered(self, version: int) -> bool:
        """Is the pull of `version` answered: every stage of it here, or word that it is over?"""
        return answers(self.over, version) or all(answers(m, version) for m in self.got)

    def reset(self) -> None:
        self.got, self.over = [None] * len(self.got), None

    def consumed(self) -> None:
        """The slice is in the model: keep no reference to what it arrived in (a whole slice, when not in place)."""
        self.got = [None] * len(self.got)
