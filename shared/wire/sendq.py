"""Sending from a server's loop without ever waiting on the peer: messages handed to ZeroMQ as its socket takes them.

A DEALER's send blocks while its pipe to the peer holds SNDHWM messages, and that pipe fills whenever the peer does
not read: SIGSTOPped, or behind a link cut one way, where TCP (without shared/runtime/links.py's user timeout)
retransmits with a backoff that reaches two minutes between tries while the connection stays "established". A loop
that sends there blocks until the peer reads again; a loop that sends without a bound on what it keeps grows without
one. So a server's loop puts each logical message (the ZeroMQ messages of `transfer.messages`) here, and `flush`
hands over what the socket takes now (NOBLOCK) and keeps the rest, in order, for its next turn. Once ZeroMQ takes
a message's first frame it takes all of them (its high-water mark counts whole messages), so a message is never
handed over in part; a logical message of several may be, and the rest follows on a later `flush`.

At most `limit` logical messages wait here; past that the oldest one not begun is dropped, counted and logged: what
its sender needs delivered is resent by the sender on a timer anyway (the step log keeps each entry until it is
acknowledged: services/aggregator/steplog/), and what it says periodically (a shard's `shard_have`, `shard_ready`)
is said again.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import zmq
from cmemi.shared.wire import protocol


class SendQueue:
    def __init__(self, what: str, limit: int, log: Any) -> None:
        """`what`: the peer, for the drop's log line; `limit`: logical messages kept at most; `log`: a structlog
        logger."""
        self.what, self.limit, self.log = what, limit, log
        self.items: deque[list[list[Any]]] = deque()  # logical messages not wholly handed over, oldest first
        self.begun = 0  # how many of the first one's ZeroMQ messages ZeroMQ holds already
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.items)

    def put(self, msgs: list[list[Any]]) -> None:
        """Keep one logical message (its ZeroMQ messages, in order) for `flush`; the list given is not changed."""
        self.items.append(list(msgs))
        while len(self.items) > self.limit:
            del self.items[1 if self.begun else 0]  # the oldest one not begun
            self.dropped += 1
            self.log.warning("message dropped", reason="unsent", detail=f"to {self.what}: its peer does not read",
                             count=self.dropped)

    def flush(self, sock: zmq.Socket[bytes]) -> int:
        """Hand `sock` what it takes now, without waiting; returns the bytes handed over."""
        total = 0
        while self.items:
            msgs = self.items[0]
            while self.begun < len(msgs):
                try:
                    total += protocol.send(sock, msgs[self.begun], noblock=True)
                except zmq.Again:
                    return total
                msgs[self.begun] = []  # ZeroMQ holds it now (its own copy, or the buffers it was given)
                self.begun += 1
            self.items.popleft()
            self.begun = 0
        return total

    def clear(self) -> None:
        """Forget what waits (the socket it was for is gone: its sender sends again to the next one)."""
        self.items.clear()
        self.begun = 0
