"""What a parameter server sends through its ROUTER, for the leader and every shard alike: one logical message
(in parts of two chunks, `transfer.PART`, when it is bigger: a receiver that bounds its queue, RCVHWM, then holds
that much per queued part), frames already encoded by a `Publisher` going out
zero-copy under its trackers. Returns the bytes sent; a send that fails (a peer gone) is logged, not raised."""

from __future__ import annotations

from typing import Any

import structlog
import zmq
from cmemi.shared.wire import transfer

# a Publisher's frames and the trackers its sends append to; None: sent untracked (frames nobody reuses)
Encoded = tuple[tuple[list[dict[str, Any]], list[Any]], list[zmq.MessageTracker] | None]


class Outbox:
    def __init__(self, sock: zmq.Socket, run: str, cap: int, log: structlog.stdlib.BoundLogger,
                 fatal: Any) -> None:
        self.sock, self.run, self.cap, self.log, self.fatal = sock, run, cap, log, fatal

    def send(self, identity: bytes, mtype: str, encoded: Encoded | None = None, **fields: Any) -> int:
        frames, trackers = encoded if encoded is not None else (None, None)
        try:  # parameters over the cap go in parts
            msgs = transfer.messages(mtype, self.run, fields, self.cap, encoded=frames, part=transfer.PART)
        except transfer.TooBig as exc:
            self.fatal(f"aggregator: {exc}")
        try:
            return transfer.send(self.sock, msgs, identity, trackers)
        except zmq.ZMQError as exc:
            self.log.warning("send failed", error=str(exc))
            return 0
