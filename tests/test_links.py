"""shared/runtime/links.py: the options every socket that may cross hosts gets (the outage itself is measured across
emulated hosts in tests/test_netns_links.py)."""

from __future__ import annotations

import zmq
from cmemi.shared.config.loading import load_config
from cmemi.shared.runtime import links

from tests.conftest import DIGITS


def test_every_socket_gets_a_user_timeout_keepalive_and_fast_redials_and_no_zeromq_heartbeats() -> None:
    """No heartbeats: with them libzmq 4.3.5 aborts on a peer's reset (links.py; tests/test_zmq_abort.py)."""
    cfg = load_config(DIGITS, ["cluster.dead_after=4.0", "cluster.heartbeat_interval=0.3"])
    zctx = zmq.Context()
    try:
        sock = zctx.socket(zmq.DEALER)
        links.set_link_options(sock, cfg.cluster)
        got = {opt: sock.getsockopt(opt) for opt in (
            zmq.TCP_MAXRT, zmq.HEARTBEAT_IVL, zmq.HEARTBEAT_TIMEOUT, zmq.TCP_KEEPALIVE, zmq.TCP_KEEPALIVE_IDLE,
            zmq.TCP_KEEPALIVE_INTVL, zmq.CONNECT_TIMEOUT, zmq.RECONNECT_IVL, zmq.RECONNECT_IVL_MAX)}
        sock.close(linger=0)
    finally:
        zctx.term()
    assert got == {zmq.TCP_MAXRT: 2000, zmq.HEARTBEAT_IVL: 0, zmq.HEARTBEAT_TIMEOUT: -1, zmq.TCP_KEEPALIVE: 1,
                   zmq.TCP_KEEPALIVE_IDLE: 1, zmq.TCP_KEEPALIVE_INTVL: 1, zmq.CONNECT_TIMEOUT: 500,
                   zmq.RECONNECT_IVL: 100, zmq.RECONNECT_IVL_MAX: 250}


def test_the_link_timeout_follows_dead_after_but_never_under_a_second() -> None:
    assert links.link_timeout(load_config(DIGITS, ["cluster.dead_after=2.0"]).cluster) == 1.0
    assert links.link_timeout(load_config(DIGITS, ["cluster.dead_after=1.0"]).cluster) == 1.0
    assert links.link_timeout(load_config(DIGITS, ["cluster.dead_after=6.0"]).cluster) == 3.0
