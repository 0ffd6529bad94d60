"""How a shard k > 0 joins its leader's term: it finds the leader through Redis, restores exactly the checkpoint
the leader restored (its own slice of it), and opens its link to the leader (docs/design.md §4)."""

from __future__ import annotations

import time

import redis
import zmq
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.snapshots import contents as snapshots
from cmemi.services.aggregator.snapshots.send import CheckpointerLink
from cmemi.shared.coordination.membership import table
from cmemi.shared.runtime.links import set_link_options
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import samehost


def find_leader(ctx: ServiceContext, shard: int) -> tuple[int, str, int]:
    """(term, address, step it restored or -1) of the leader, once it has advertised them."""
    cfg = ctx.cfg
    deadline = time.monotonic() + cfg.cluster.start_timeout
    while time.monotonic() < deadline and not ctx.stopping.is_set():
        try:
            info = table(ctx.redis.hgetall(ctx.keys.aggregator))
        except redis.RedisError:
            info = {}
        if {"addr", "term", "restored"} <= info.keys():
            return int(info["term"]), info["addr"], int(info["restored"])
        time.sleep(0.05)
    ctx.fatal(f"shard {shard}: no leader (shard 0) advertised itself within {cfg.cluster.start_timeout:g} s; is "
              "`cmemi aggregator` (shard 0) running?")
    raise AssertionError("not reached")


def restore_slice(ctx: ServiceContext, trainer: Trainer, totals: RunTotals, ckpt: CheckpointerLink,
                  restored_step: int, shard: int, newest: bool = False) -> int:
    """This shard's slice of the checkpoint the leader restored, or (`newest`: restarted within a term whose leader
    has moved on, the step log in use) of the newest complete one: a checkpoint written since drops the log's
    entries it covers, so the replay starts there (services/aggregator/leader/roster.py `Restarts`). Returns the
    step it joins at (-1: that checkpoint is gone, which rolls the cluster back)."""
    if restored_step < 0 and not newest:
        return trainer.step
    msg = ckpt.fetch_latest(timeout=120, trainer=trainer, step=None if newest else restored_step)
    if newest and msg is None and restored_step < 0:
        return trainer.step  # (none written yet: the run's start, a pure function of the config)
    if msg is None or msg.header["step"] < restored_step or (not newest and msg.header["step"] != restored_step):
        # retention removed it: the leader has run on since, so this is a restart within its term, which
        # rolls the cluster back anyway (the leader leaves the term when this shard joins at another step)
        ctx.log.warning("the checkpoint the leader restored is gone; joining to roll the cluster back",
                        step=restored_step)
        return -1
    try:
        snapshots.restore(trainer, totals, None, None, msg.header["meta"], msg.tensors)
    except snapshots.NOT_RESTORABLE as exc:
        ctx.fatal(f"shard {shard}: cannot restore checkpoint of step {restored_step}: {exc}")
    return trainer.step


def leader_link(ctx: ServiceContext, zctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = zctx.socket(zmq.DEALER)
    set_link_options(sock, ctx.cfg.cluster)
    ctx.curve.connect_as_client(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, ctx.cfg.cluster.message_cap())
    sock.connect(samehost.tcp_of(addr))  # shard to leader: CurveZMQ always (only workers use ipc://)
    return sock
