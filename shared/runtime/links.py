"""The options every ZeroMQ socket that may cross hosts gets, so a dead link costs its length, not twice it.

Without them a cut link is noticed by nothing but TCP's retransmission backoff: the connection stays
"established", what was sent during the outage is retransmitted 0.2, 0.6, 1.4, 3.0, 6.2, 12.6 ... s after the first
loss, and training resumes only at the first retransmission after the link is back (issue 47: a 14.2 s port-down
on the leader gave 26.8 s without a step; tests/test_netns_links.py: a 4 s one gave 6.67 s, 4.30 s with these).
Here, with T = `link_timeout(cluster)` = max(1 s, cluster.dead_after / 2):

- TCP user timeout (ZMQ_TCP_MAXRT = T; TCP_USER_TIMEOUT on Linux): data unacknowledged for T aborts the
  connection, on either end, and ZeroMQ dials again. A slow link (data acknowledged slowly) is never cut by it; a
  live peer that reads nothing for T is: since Linux 5.11 ("tcp: fix TCP_USER_TIMEOUT with zero window") a
  receive window closed for T ends the sender's connection even while the window probes are answered (issue 47:
  on 6.18 a loopback sender under T = 1 s got ETIMEDOUT, its reader a reset). So every loop that serves a link
  reads it at least every T: its ZeroMQ stops reading the kernel once RCVHWM messages wait, and a reset that finds
  a connection stopped so trips libzmq's `!_io_error` abort (docs/concepts/faults.md, "libzmq aborts"). A shard's
  final slice, sent while the leader waited for the final checkpoint without reading, did (shard/upstream.py
  `finish`).
- ZeroMQ heartbeats, a PING every cluster.heartbeat_interval: no connection is ever idle, so an end that only waits
  (for work, for a gradient) has a PING unacknowledged during a cut and its user timeout fires too. Their own
  timeout and TTL (`FROZEN_PEER_S`) are long on purpose: libzmq counts only complete frames as signs of life, and
  one 4 MiB frame takes seconds on a slow link (tests/test_slow_link.py: about 5.6 s at 6 Mbit/s); they catch
  only a peer whose kernel answers while its ZeroMQ does not.
- TCP keepalive (idle 1 s, the least ZeroMQ takes, then every 1 s): the last resort for a connection without
  heartbeats; Linux ends it at the user timeout after the first unanswered probe.
- Re-dials 0.1 s after a connection is lost, backing off to at most `RECONNECT_MAX_S`, and a dial unanswered for
  `CONNECT_TIMEOUT_S` is given up and made again (ZMQ_CONNECT_TIMEOUT): a SYN lost in the outage would otherwise
  be retried by the kernel 1, 3, 7, 15 s after it was sent. (The first draft re-dialled every 0.5 s after a 1 s
  dial timeout: the 4 s port-down above then cost D + 1.4 s.)

So a link cut for d seconds is given up within T (+ one heartbeat interval) of the cut, on both ends, and is up
again within CONNECT_TIMEOUT_S + RECONNECT_MAX_S of its return; what was queued meanwhile (a worker's re-ask) goes
out then. A link that comes back before T is never given up. `docs/concepts/faults.md` (links) has the formula.
"""

from __future__ import annotations

import zmq
from cmemi.shared.config.system import ClusterConfig

RECONNECT_IVL_S = 0.1  # the first re-dial after a connection is lost
RECONNECT_MAX_S = 0.25  # re-dials back off to at most this
CONNECT_TIMEOUT_S = 0.5  # a dial unanswered this long is given up and made again (a SYN-ACK takes ms on a LAN)
FROZEN_PEER_S = 60.0  # ZeroMQ's own heartbeat timeout/TTL (see the module docstring: why long)
KEEPALIVE_IDLE_S = 1  # whole seconds: ZeroMQ's TCP keepalive options take nothing finer
KEEPALIVE_INTVL_S = 1
KEEPALIVE_CNT = 2


def link_timeout(cluster: ClusterConfig) -> float:
    """T: seconds a link may hold unacknowledged data (or leave a dial unanswered) before it is given up."""
    return max(1.0, cluster.dead_after / 2)


def set_link_options(sock: zmq.Socket[bytes], cluster: ClusterConfig) -> None:
    """Set every option above on `sock`, before it connects or binds (they apply to its later connections)."""
    timeout_ms = int(link_timeout(cluster) * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(cluster.heartbeat_interval * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(FROZEN_PEER_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(FROZEN_PEER_S * 1000))  # sent to the peer (whole tenths of a second)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
    sock.setsockopt(zmq.TCP_MAXRT, timeout_ms)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, int(min(CONNECT_TIMEOUT_S, link_timeout(cluster)) * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL, int(RECONNECT_IVL_S * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(RECONNECT_MAX_S * 1000))
