"""A step log entry as the step's encoded gradients (services/aggregator/steplog/frames.py, issue 47): what a server
keeps of each accepted contribution, the entry made of them, and a replay that decodes and reduces them again
ending bitwise where the live steps ended — parameters, optimizer state, LR and the downlink mirror with its codec's
warm-started Q — while the entry is a fraction of the reduced slice's bytes."""

from __future__ import annotations

import random
from pathlib import Path

import msgpack
import pytest
import torch
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.services.aggregator.common.gradients import decode
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.steplog import frames
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.loading import load_config
from cmemi.shared.wire import limits

from tests.conftest import DIGITS
from tests.test_steplog_ef import SYNC, leader_killed_runs_to_the_reference
from tests.test_steplog_local import FAULTS

PSGD = ("compression.codec=powersgd", "compression.powersgd_rank=2", "compression.downlink=powersgd")
NODES = [(0, 2), (2, 3), (3, 4)]  # M = 4: a block of two and two leaves, subtrees of the reduction tree


def live_steps(cfg, steps: int) -> tuple[Trainer, list[tuple[dict, dict[str, torch.Tensor], int, int]]]:
    """A trainer stepped `steps` times from gradients encoded by per-node worker codecs and received in a shuffled
    order, as a server takes them (decode, offer to the step's collector, its mean); with each step's entry as its encoded gradients:
    (its `encoded` field after msgpack, as the checkpointer's spool holds it; its tensors; their bytes; the slice's)."""
    live = Trainer(cfg)
    workers = {node: make_codec(cfg.compression) for node in NODES}
    server = make_codec(cfg.compression, check_finite=False)
    g, order = torch.Generator().manual_seed(0), random.Random(1)
    entries = []
    for step in range(steps):
        collector = StepCollector(step, cfg.train.microbatches, leased=False)
        arrivals = list(NODES)
        order.shuffle(arrivals)
        for lo, hi in arrivals:
            info, encoded = workers[(lo, hi)].encode({n: torch.randn(s, generator=g) * 0.1
                                                      for n, s in live.shapes.items()}, step)
            h = {"lo": lo, "hi": hi, "finite": True, "losses": [0.5] * (hi - lo),
                 "codec": msgpack.unpackb(msgpack.packb(info))}
            kept = frames.received(h, encoded)
            grads, bad, _ = decode(server, live, h, encoded)
            assert bad is None
            assert collector.offer((lo, hi), grads, h["losses"], None, keep=kept) is None
        mean, _ = collector.mean()
        assert mean is not None and frames.smaller(collector.kept, mean, collector.M)
        field, tensors = frames.entry(collector.kept, collector.M)
        entries.append((msgpack.unpackb(msgpack.packb(field)), {n: t.clone() for n, t in tensors.items()},
                        limits.nbytes(tensors.values()), limits.nbytes(mean.values())))
        live.apply(mean)
    return live, entries


def test_a_replay_of_frame_entries_ends_bitwise_where_the_live_steps_ended(tmp_path: Path) -> None:
    """PowerSGD rank 2 both ways: six steps live, then a fresh trainer replays only their frame entries. Parameters,
    optimizer state, LR, the mirror and its codec's state (the downlink's warm-started Q) are bitwise the live ones."""
    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", *PSGD])
    live, entries = live_steps(cfg, 6)
    replayed = Trainer(cfg)
    codec = make_codec(cfg.compression, check_finite=False)
    for field, tensors, _, _ in entries:
        replayed.apply(frames.reduce(codec, replayed, replayed.step, field, tensors))
    assert replayed.step == live.step == 6
    assert replayed.params_sha256() == live.params_sha256()
    a, b = replayed.optimizer.state_dict()["state"], live.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k]["momentum_buffer"], b[k]["momentum_buffer"]) for k in a)
    assert replayed.lr == live.lr
    assert replayed.mirror is not None and live.mirror is not None
    assert replayed.mirror_hashes() == live.mirror_hashes()
    ra, la = replayed.mirror.codec.state_dict(), live.mirror.codec.state_dict()
    assert ra and ra.keys() == la.keys() and all(torch.equal(ra[k], la[k]) for k in ra)


def test_a_frame_entry_is_the_encoded_bytes_not_the_dense_slice(tmp_path: Path) -> None:
    """Each entry's tensors are exactly its contributions' encoded frames, well under the reduced slice's bytes."""
    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", *PSGD])
    _, entries = live_steps(cfg, 2)
    for field, tensors, nbytes, dense in entries:
        assert [tuple(p[:2]) for p in field["parts"]] and field["microbatches"] == 4
        assert nbytes == limits.nbytes(tensors.values()) and nbytes * 2 < dense, (nbytes, dense)
        assert all(name.startswith(frames.FRAME) for name in tensors)


def test_gradients_are_kept_only_while_fewer_bytes_than_the_slice_and_only_a_whole_step_goes_encoded() -> None:
    """`room`: a server keeps the step's gradients only while they are fewer bytes than its dense slice (its memory:
    at most a slice and a gradient more); `smaller`: an entry goes encoded only if they cover every microbatch."""
    half = [frames.Received(lo, lo + 2, True, [0.5, 0.5], {}, {"w#p": torch.zeros(10)}) for lo in (0, 2)]  # 40 B
    dense = {"w": torch.zeros(100)}  # 400 B
    assert frames.room(half * 4, 400) and not frames.room(half * 5, 400)
    assert frames.smaller(half, dense, 4) and not frames.smaller(half[:1], dense, 4)
    assert not frames.smaller(half * 5, dense, 20) and not frames.smaller(half, None, 4)


def test_a_malformed_frame_entry_is_a_clear_error(tmp_path: Path) -> None:
    """A part missing, a frame missing, a field of the wrong shape: an EntryError naming what is wrong."""
    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", *PSGD])
    _, entries = live_steps(cfg, 1)
    field, tensors, _, _ = entries[0]
    trainer, codec = Trainer(cfg), make_codec(cfg.compression, check_finite=False)
    with pytest.raises(frames.EntryError, match="cover 2 of 4 microbatches"):
        frames.reduce(codec, trainer, 0, {**field, "parts": [p for p in field["parts"] if p[:2] != [0, 2]]}, tensors)
    with pytest.raises(frames.EntryError, match="does not decode"):
        frames.reduce(codec, trainer, 0, field, {n: t for n, t in tensors.items() if not n.endswith("#q")})
    with pytest.raises(frames.EntryError, match="malformed"):
        frames.reduce(codec, trainer, 0, {"parts": "x", "microbatches": 4}, tensors)
    with pytest.raises(frames.EntryError, match="part 0 is malformed"):
        frames.reduce(codec, trainer, 0, {**field, "parts": [[0, 4]]}, tensors)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,memory_mb", [("auto", 64), ("tcp", 64), ("tcp", 0)])
def test_encoded_entries_go_through_the_real_log_and_replay_bitwise(tmp_path: Path, redis_server, transport: str,
                                                                    memory_mb: int) -> None:
    """A leader's StepLogLink and the checkpointer's LogServer, in process: entries of encoded gradients staged (into
    the slot on this host, kept buffers over tcp://), held opaque (in memory, or past the bound on disk) and read back
    by a replay: the field as sent, the frames bitwise, and reduced they step a trainer to the live one's state."""
    import zmq
    from cmemi.services.aggregator.steplog.link import StepLogLink
    from cmemi.services.aggregator.steplog.reading import LogEntries

    from tests.helpers.logserver import log_server
    from tests.helpers.rig import context

    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", *PSGD])
    live, entries = live_steps(cfg, 4)
    ctx = context(tmp_path, redis_server.url, f"cluster.transport={transport}",
                  f"checkpoint.step_log_memory_mb={memory_mb}", "cluster.max_message_bytes=16777216")
    ctx.redis.set(ctx.keys.term, 1)
    zctx = zmq.Context()
    try:
        with log_server(tmp_path, ctx, zctx, memory_mb):
            link = StepLogLink(ctx, zctx, term=1)
            for step, (field, tensors, _, _) in enumerate(entries, start=1):
                link.ship_staged(step, link.stage(None, None, tensors), False, None, 0.5, None, None, field)
                assert link.confirm(lambda s: pytest.fail(f"log_gap at {s}")) is False
            assert link.entries == link.encoded_entries == 4
            assert link.entry_bytes == sum(e[2] for e in entries)  # the frames' bytes, not the dense slices'
            link.close()
            ctx.redis.set(ctx.keys.term, 2)
            replayer, replayed = StepLogLink(ctx, zctx, term=2), Trainer(cfg)
            codec = make_codec(cfg.compression, check_finite=False)
            for msg, (field, tensors, _, _) in zip(LogEntries(replayer).entries(0), entries, strict=True):
                assert msg.header["encoded"] == field and ("shm" in msg.header) == (transport == "auto")
                assert msg.tensors.keys() == tensors.keys() and all(torch.equal(msg.tensors[n], t) for n, t in tensors.items())
                replayed.apply(frames.reduce(codec, replayed, replayed.step, msg.header["encoded"], msg.tensors))
            assert replayed.params_sha256() == live.params_sha256()
            replayer.close()
    finally:
        zctx.term()


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_powersgd_k2_leader_then_shard_killed_replays_frame_entries_to_the_reference(tmp_path: Path,
                                                                                     transport: str) -> None:
    """PowerSGD rank 2, K = 2, W = 1, no checkpoint but the final one: the leader SIGKILLed mid-run, then shard 1.
    Every replay goes through frame entries (each server's shipped as its received gradients; on this host through
    the servers' slots, or with `tcp` as frames over tcp://): no step twice, the reference's params_sha256, and the
    leader's entries a fraction of its slice's dense bytes."""
    sets = (*SYNC, "compression.codec=powersgd", "compression.powersgd_rank=2", "cluster.shards=2",
            f"cluster.transport={transport}")
    c = leader_killed_runs_to_the_reference(tmp_path, sets, [(40, 120), (160, 240)], server=("0", "1"))
    dense = limits.nbytes(Trainer(load_config(DIGITS, [f"run.dir={tmp_path}", *sets, *FAULTS]), shard=0).pieces.values())
    assert c.summary["step_log_encoded_entries"] > 0, c.summary
    assert 0 < c.summary["step_log_bytes"] * 2 < dense, (c.summary["step_log_bytes"], dense)


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(400)
def test_int4_two_workers_leader_then_shard_killed_replay_the_live_reduction(tmp_path: Path) -> None:
    """int4 (stateless: the same bits at any W), K = 2, W = 2, M = 4: a step's entry holds the contributions of both
    workers, which a replay must reduce by the live step's tree, not in the order they were logged; the leader and then
    shard 1 SIGKILLed mid-run replay to the W = 1 reference's params_sha256, no step twice."""
    sets = (*SYNC, "compression.error_feedback=false", "compression.codec=int4", "cluster.shards=2")
    c = leader_killed_runs_to_the_reference(tmp_path, sets, [(40, 120), (160, 240)], server=("0", "1"), workers=2)
    assert c.summary["step_log_encoded_entries"] > 0, c.summary
