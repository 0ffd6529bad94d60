"""A service never aborts inside libzmq when a peer dies while the service is not reading it (issue 47: the
1,000-fault soak lost leader and shard processes to `Assertion failed: !_io_error (src/stream_engine_base.cpp:310)`).

Each round (tests/helpers/zmq_abort.py) runs a server process with a service's ROUTER (the project's link options,
CurveZMQ, RCVHWM = 2) that stops reading, a client process that fills it and is SIGKILLed, and a reply from the
server to the dead client; every other round a hostile raw TCP client (garbage, a bare greeting, resets, a
half-open connection) comes first. With ZeroMQ heartbeats on the server's link options (as shared/runtime/links.py
had them) every round aborted; without them none does. The second test keeps the reproducer honest: with the
server's heartbeats turned back on it must still abort, or libzmq has fixed the bug and links.py may take
heartbeats back (its docstring says why they are off).
"""

from __future__ import annotations

import pytest

from tests.helpers import zmq_abort

pytestmark = [pytest.mark.integration, pytest.mark.fault]

ROUNDS = 6
DEADLINE_S = 25.0  # no round starts after it (a round takes about a second plus two Python starts)


@pytest.mark.timeout(90)
def test_a_peer_killed_while_the_server_is_not_reading_it_does_not_abort_the_server() -> None:
    ran, aborts = zmq_abort.rounds(ROUNDS, DEADLINE_S, with_hostile=True)
    assert ran >= 2, f"only {ran} round(s) within {DEADLINE_S:g} s"
    assert aborts == 0, f"the server died of libzmq's !_io_error abort in {aborts} of {ran} rounds"


@pytest.mark.timeout(90)
def test_the_reproducer_still_aborts_libzmq_with_the_heartbeats_links_py_turned_off() -> None:
    ran, aborts = zmq_abort.rounds(ROUNDS, DEADLINE_S, server_ping=200, stop_at_abort=True)
    assert aborts == 1, (f"no abort in {ran} rounds with the server's ZeroMQ heartbeats on: this libzmq may have "
                         "fixed zeromq/libzmq#4841 (shared/runtime/links.py explains why heartbeats are off)")
