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
  a connection stopped so tripped libzmq's `!_io_error` abort while heartbeats were on (below). A shard's final
  slice, sent while the leader waited for the final checkpoint without reading, did (shard/upstream.py `finish`).
- No ZeroMQ heartbeats (ZMQ_HEARTBEAT_IVL stays 0, on both ends): in libzmq 4.3.5 (pyzmq 27.3's, the newest
  release; its master is unchanged) they abort the process. A connection that fails (a peer's reset, this
  user timeout) while its input is stopped (RCVHWM messages wait for the reader) is only taken off epoll and
  marked failed (`_io_error`, stream_engine_base.cpp:249); the heartbeat timer's PING (ZMQ_HEARTBEAT_IVL on this
  end) and the PONG to a PING decoded when the reader drains (ZMQ_HEARTBEAT_IVL on the other end) then call
  `out_event`, which asserts `!_io_error`: SIGABRT (zeromq/libzmq#4841; the 1,000-fault soak lost 16 servers to it,
  bench/results/soak.json). Every other write path checks the flag first. tests/test_zmq_abort.py reproduces it
  with each end's heartbeats and shows that without them the server lives (tests/helpers/zmq_abort.py).
- TCP keepalive instead (idle 1 s, the least ZeroMQ takes, then every 1 s) keeps an end that only waits (for
  work, for a gradient) from holding a dead connection: Linux ends it once it has sent a probe unanswered and
  heard nothing for T, so it is given up max(2 s, ⌈T⌉) after the last packet it received (whole seconds, as
  the probes go), where the PINGs gave T plus one heartbeat interval. An end with data unacknowledged gives up at T
  either way. The heartbeats' own timeout also caught a peer whose kernel answers while its ZeroMQ does not (a
  SIGSTOPped process); such a peer is now left to membership (cluster.dead_after) and, once its receive window
  closes, to the sender's user timeout.
- Re-dials 0.1 s after a connection is lost, backing off to at most `RECONNECT_MAX_S`, and a dial unanswered for
  `CONNECT_TIMEOUT_S` is given up and made again (ZMQ_CONNECT_TIMEOUT): a SYN lost in the outage would otherwise
  be retried by the kernel 1, 3, 7, 15 s after it was sent. (The first draft re-dialled every 0.5 s after a 1 s
  dial timeout: the 4 s port-down above then cost D + 1.4 s.)

So a link cut for d seconds is given up within max(2 s, ⌈T⌉) of the cut, on both ends, and is up
again within CONNECT_TIMEOUT_S + RECONNECT_MAX_S of its return; what was queued meanwhile (a worker's re-ask) goes
out then. A link that comes back before T is never given up. `docs/concepts/faults.md` (links) has the formula.
"""

from __future__ import annotations

import zmq
from cmemi.shared.config.system import ClusterConfig

RECONNECT_IVL_S = 0.1  # the first re-dial after a connection is lost
RECONNECT_MAX_S = 0.25  # re-dials back off to at most this
CONNECT_TIMEOUT_S = 0.5  # a dial unanswered this long is given up and made again (a SYN-ACK takes ms on a LAN)
KEEPALIVE_IDLE_S = 1  # whole seconds: ZeroMQ's TCP keepalive options take nothing finer
KEEPALIVE_INTVL_S = 1
KEEPALIVE_CNT = 2


def link_timeout(cluster: ClusterConfig) -> float:
    """T: seconds a link may hold unacknowledged data (or leave a dial unanswered) before it is given up."""
    return max(1.0, cluster.dead_after / 2)


def set_link_options(sock: zmq.Socket[bytes], cluster: ClusterConfig) -> None:
    """Set every option above on `sock`, before it connects or binds (they apply to its later connections)."""
    timeout_ms = int(link_timeout(cluster) * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 0)  # libzmq's default, said here: heartbeats abort it (module docstring)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
    sock.setsockopt(zmq.TCP_MAXRT, timeout_ms)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, int(min(CONNECT_TIMEOUT_S, link_timeout(cluster)) * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL, int(RECONNECT_IVL_S * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(RECONNECT_MAX_S * 1000))
