"""One snapshot on its way to the checkpointer: sent a part at a time, and copy-on-write.

A snapshot names the live tensors (the model's pieces, the optimizer's state; `state.flatten(copy=False)`):
taking it copies nothing. Its parts (about two chunks each, transfer.PART) go out as
the socket takes them — it holds at most one more (SNDHWM 1) — and each is copied into ZeroMQ's own
buffer as it goes, so the live tensors may change as soon as the send returns. Before they do (the next
optimizer step), `protect` copies the parts not sent yet. A snapshot therefore costs the parts still
unsent when the next step comes, and the one or two in ZeroMQ, instead of a whole copy of the state per
checkpoint (docs/design.md, "Memory").

After a checkpointer restart a snapshot is sent again from its start, as a new transfer, while the live
tensors still hold its bytes (no step since), or while none of it had gone out when they changed (its
parts are copies then); otherwise it cannot be rebuilt and is given up: the next boundary's goes instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq


class Outgoing:
    def __init__(self, step: int, final: bool, build: Callable[[], list[list[Any]]]) -> None:
        self.step, self.final, self.build = step, final, build  # build: the messages of transfer.messages
        self.msgs = build()
        self.next = 0  # the first message not handed to ZeroMQ yet
        self.changed = False  # the live tensors changed since: the unsent messages are copies
        self.to: tuple[str | None, str | None] | None = None  # the checkpointer (address, incarnation) sent to

    @property
    def sent(self) -> bool:
        return self.next == len(self.msgs)

    def pump(self, sock: zmq.Socket) -> None:
        """Hand ZeroMQ what it takes now (copied: the live tensors stay free to change)."""
        while self.next < len(self.msgs):
            try:
                sock.send_multipart(self.msgs[self.next], flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self.msgs[self.next] = []  # sent: nothing here references its bytes any more
            self.next += 1

    def protect(self) -> None:
        """The live tensors are about to change: copy what is not sent yet."""
        if not self.changed:
            self.changed = True
            self.msgs[self.next:] = [[bytes(f) for f in m] for m in self.msgs[self.next:]]

    def restart(self) -> bool:
        """Send again from the first part (a new transfer); False if that cannot give the snapshot's bytes."""
        if not self.changed:
            self.msgs = self.build()
        elif self.next:
            return False
        self.next = 0
        return True
