"""A ROUTER and a DEALER over loopback TCP, as tests that drive one end of a link by hand need them (review finding
D2: the same bind/connect lines were written out in each such test).

`pair` binds the ROUTER to a free port (port 0: never a fixed one) and connects the DEALER; `joined_pair` also has
the DEALER say hello and the ROUTER read it, since a ROUTER drops what it sends to a peer it has not heard from yet.
"""

from __future__ import annotations

from collections.abc import Mapping

import zmq

JOIN_MS = 10_000  # the hello must arrive within this (a loaded CI host)


def pair(ctx: zmq.Context, router_options: Mapping[int, int] | None = None,
         dealer_options: Mapping[int, int | bytes] | None = None) -> tuple[zmq.Socket, zmq.Socket]:
    """(router, dealer): each socket's options set before it binds or connects (they apply to the connection)."""
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock, options in ((router, router_options), (dealer, dealer_options)):
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


def joined_pair(ctx: zmq.Context, hello: bytes = b"hello", identity: bytes | None = None
                ) -> tuple[zmq.Socket, zmq.Socket, list[bytes]]:
    """(router, dealer, what the router read of the hello: [the dealer's routing id, hello]); the DEALER takes
    `identity` as its routing id if given."""
    router, dealer = pair(ctx, dealer_options=None if identity is None else {zmq.IDENTITY: identity})
    dealer.send(hello)
    assert router.poll(JOIN_MS), f"the DEALER's hello did not reach the ROUTER within {JOIN_MS / 1000:g} s"
    return router, dealer, router.recv_multipart()
