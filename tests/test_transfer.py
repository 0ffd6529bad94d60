"""Big messages in parts (shared/wire/transfer.py cuts, shared/wire/assembly.py reassembles): bit-exact round trips, and every hostile sequence of parts is
dropped with its reason while memory stays bounded. Fast: no processes; one pair of real sockets."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import torch
import zmq
from cmemi.shared.wire import assembly, protocol, transfer
from cmemi.shared.wire.protocol import ProtocolError

from tests.helpers.sockets import joined_pair

RUN = "r1"
CAP = 1 << 16
FIELDS = {"step": 7, "term": 2, "final": False, "meta": {"k": [1, 2]}}


def big_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "huge": torch.randn(5 * CAP // 4 + 3, generator=g),  # several chunks, the last one short
        "bf16": torch.randn(3000, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "f64": torch.randn(17, 3, generator=g, dtype=torch.float64),
        "i64": torch.arange(20000),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.arange(99) % 3 == 0,
        "scalar": torch.tensor(2.5),
        "empty_end": torch.zeros(0, dtype=torch.int32),
    }


def snapshot_parts(tensors: dict[str, torch.Tensor], cap: int = CAP) -> list[list[bytes]]:
    return [[bytes(f) for f in m] for m in transfer.messages("snapshot", RUN, FIELDS, cap, tensors)]


def headers(msgs: list[list[bytes]]) -> list[dict]:
    return [msgpack.unpackb(m[0]) for m in msgs]


class Drops:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def __call__(self, reason: str, detail: str) -> None:
        self.reasons.append(reason)


def feed_all(asm: assembly.Assembler, msgs: list[list[bytes]], peer: bytes = b"p", **kw) -> protocol.Message | None:
    out = None
    for i, m in enumerate(msgs):
        out = asm.decode(peer, m, **kw)
        assert (out is None) == (i < len(msgs) - 1)
    return out


def test_round_trip_in_parts_is_bit_exact_and_each_part_fits_the_cap() -> None:
    tensors = big_tensors()
    msgs = snapshot_parts(tensors)
    assert len(msgs) > 5 and all(protocol.message_bytes(m) <= CAP for m in msgs)
    hs = headers(msgs)
    assert {h["type"] for h in hs} == {"part"} and len({h["xfer"] for h in hs}) == 1
    assert [h["index"] for h in hs] == list(range(len(msgs))) and "of" in hs[0] and "of" not in hs[1]
    # "huge" is cut on the chunk grid: equal chunks, the last one shorter
    huge = [e[2] for h in hs for e in h["frames"] if e[0] == 0]
    assert len(huge) > 4 and len(set(huge[:-1])) == 1 and huge[-1] < huge[0] and huge[0] % 64 == 0
    msg = feed_all(assembly.Assembler(RUN, bound=1 << 30), msgs)
    assert msg is not None and msg.type == "snapshot" and msg.header["meta"] == FIELDS["meta"]
    for name, t in tensors.items():
        got = msg.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert protocol.tensor_bytes(got).tobytes() == protocol.tensor_bytes(t.contiguous()).tobytes(), name


def test_a_message_that_fits_is_sent_whole_and_decodes_as_before() -> None:
    small = {"w": torch.randn(100)}
    msgs = transfer.messages("snapshot", RUN, FIELDS, CAP, small)
    assert len(msgs) == 1 and msgpack.unpackb(msgs[0][0])["type"] == "snapshot"
    assert len(msgs[0]) == 2  # header + one frame, as protocol.encode builds it
    msg = assembly.Assembler(RUN, bound=1 << 30).decode(b"p", [bytes(f) for f in msgs[0]])
    assert torch.equal(msg.tensors["w"], small["w"])


def test_parts_over_real_sockets_land_in_the_into_tensors() -> None:
    """Chunks of 1 MiB go out zero-copy (memoryview slices of the tensors) and land in `into` in place."""
    cap = 1 << 20
    tensors = {"a": torch.randn(3 * cap // 4 + 5), "b": torch.randn(10)}
    into = {"a": torch.empty(3 * cap // 4 + 5), "b": torch.empty(10)}
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        msgs = transfer.messages("snapshot", RUN, FIELDS, cap, tensors)
        assert len(msgs) >= 3 and all(protocol.message_bytes(m) <= cap for m in msgs)
        transfer.send(a, msgs)
        asm, msg = assembly.Assembler(RUN, bound=1 << 30), None
        for _ in msgs:
            assert b.poll(10_000)
            msg = asm.recv(b, into=into)
        assert msg is not None and not asm.pending
        for n in tensors:
            assert msg.tensors[n] is into[n] and torch.equal(into[n], tensors[n])
    finally:
        ctx.destroy(linger=0)


def test_sender_guard_a_header_that_leaves_no_room_for_a_chunk() -> None:
    meta = {"blob": "x" * CAP}  # the logical header alone is over the cap
    with pytest.raises(transfer.TooBig, match=r"'snapshot' message of \d+ bytes exceeds cluster.max_message_bytes=65536"):
        transfer.messages("snapshot", RUN, {**FIELDS, "meta": meta}, CAP, {"w": torch.zeros(10)})


def tamper(msgs: list[list[bytes]], i: int, **changes) -> list[list[bytes]]:
    out = [list(m) for m in msgs]
    h = msgpack.unpackb(out[i][0])
    h.update(changes)
    out[i][0] = msgpack.packb(h)
    return out


def expect_drop(msgs: list[list[bytes]], reason: str, bound: int = 1 << 30, at: int | None = None) -> Drops:
    """Feed `msgs`; the part at `at` (default: the last) must be dropped with `reason`; nothing completes."""
    drops = Drops()
    asm = assembly.Assembler(RUN, bound=bound, on_abandon=drops)
    at = len(msgs) - 1 if at is None else at
    for i, m in enumerate(msgs):
        if i == at:
            with pytest.raises(ProtocolError) as err:
                asm.decode(b"p", m)
            assert err.value.reason == reason, str(err.value)
        else:
            assert asm.decode(b"p", m) is None
    assert not asm.pending  # nothing partial is kept after a drop
    return drops


def test_hostile_parts_are_dropped_with_their_reason() -> None:
    msgs = snapshot_parts(big_tensors())
    n = len(msgs)
    # out of order: part 2 before part 1 (a gap), then the late part 1 is stale
    drops = expect_drop([msgs[0], msgs[2]], "part_order")
    assert drops.reasons == ["transfer_abandoned"]
    asm = assembly.Assembler(RUN, bound=1 << 30)
    assert asm.decode(b"p", msgs[0]) is None
    for m, reason in ((msgs[2], "part_order"), (msgs[1], "stale_part"), (msgs[3], "stale_part")):
        with pytest.raises(ProtocolError) as err:
            asm.decode(b"p", m)
        assert err.value.reason == reason
    expect_drop([msgs[0], msgs[1], msgs[1]], "part_repeated")
    # a missing last part: the one after it never comes; a last part whose ranges stop short
    expect_drop([*msgs[:-2], msgs[-1]], "part_order")
    short = tamper(msgs, n - 1, frames=msgpack.unpackb(msgs[-1][0])["frames"][:-1])
    short[-1] = short[-1][:-1]
    expect_drop(short, "missing_bytes")
    # overlapping and out-of-range byte ranges
    h1 = msgpack.unpackb(msgs[1][0])
    first = h1["frames"][0]
    expect_drop(tamper(msgs, 1, frames=[[first[0], first[1] - 64, first[2]], *h1["frames"][1:]])[:2], "bad_range")
    expect_drop(tamper(msgs, 1, frames=[[first[0], first[1], 1 << 40], *h1["frames"][1:]])[:2], "bad_range")
    expect_drop(tamper(msgs, 1, frames=[[99, 0, 4], *h1["frames"][1:]])[:2], "bad_range")
    expect_drop(tamper(msgs, 1, frames=[["x", 0, 4]])[:2], "bad_range")
    # a frame whose length differs from its range; corrupted bytes
    wrong = [list(m) for m in msgs[:2]]
    wrong[1][1] = wrong[1][1][:-8]
    expect_drop(wrong, "bad_length")
    flipped = [list(m) for m in msgs]
    flipped[-1][1] = bytes([flipped[-1][1][0] ^ 1]) + flipped[-1][1][1:]  # caught where its tensor ends
    expect_drop(flipped, "bad_checksum")
    # part counts and sizes beyond the bound, before anything is allocated
    expect_drop(tamper(msgs, 0, count=1 << 40)[:1], "too_many_parts", at=0)
    expect_drop(msgs[:1], "too_big", bound=1000, at=0)
    expect_drop(tamper(msgs, 0, index=n)[:1], "bad_part", at=0)
    expect_drop(tamper(msgs, 0, of="nope")[:1], "bad_part", at=0)
    expect_drop(tamper(msgs, 0, of={**headers(msgs)[0]["of"], "run": "other"})[:1], "wrong_run", at=0)
    # a middle part of a transfer never started
    expect_drop(msgs[1:2], "unknown_transfer", at=0)


def test_a_new_transfer_interleaved_with_an_unfinished_one_replaces_it_and_memory_stays_bounded() -> None:
    tensors = big_tensors()
    one, two = snapshot_parts(tensors), snapshot_parts(tensors)
    drops = Drops()
    asm = assembly.Assembler(RUN, bound=1 << 30, peers=2, on_abandon=drops)
    assert asm.decode(b"p", one[0]) is None and asm.decode(b"p", one[1]) is None
    assert feed_all(asm, two) is not None and drops.reasons == ["transfer_interleaved"]
    with pytest.raises(ProtocolError, match="stale_part"):  # the old transfer's later parts are dropped
        asm.decode(b"p", one[2])
    # at most `peers` partial transfers in all: a third peer's transfer abandons the oldest
    for peer in (b"a", b"b", b"c"):
        assert asm.decode(peer, one[0]) is None
    assert list(asm.partials) == [b"b", b"c"] and drops.reasons[-1] == "transfer_abandoned"
    asm.keep({b"c"})
    assert list(asm.partials) == [b"c"]
    with pytest.raises(ProtocolError, match="unexpected_part"):  # the aggregator: only admitted workers
        asm.decode(b"x", one[0], allow_parts=False)
    assert list(asm.partials) == [b"c"]


def test_whole_messages_still_meet_the_old_checks() -> None:
    asm = assembly.Assembler(RUN, bound=1 << 30)
    parts = protocol.encode("saved", RUN, {"step": 1, "path": "p"})
    assert asm.decode(b"p", parts).type == "saved"
    with pytest.raises(ProtocolError, match="frame_count"):
        asm.decode(b"p", [*parts, b"extra"])
    with pytest.raises(ProtocolError, match="unexpected_part"):  # a plain decoder refuses parts
        protocol.decode(snapshot_parts(big_tensors())[0], RUN)


def test_the_default_cap_stops_scaling_with_the_model_but_the_logical_bound_does_not(monkeypatch) -> None:
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.wire import limits

    from tests.conftest import DIGITS
    small = load_config(DIGITS, [])
    derived = 4 * limits.model_bytes(small) + limits.MARGIN
    assert limits.derive_max_message_bytes(small) == derived == limits.logical_bytes(small)  # digits: as before
    monkeypatch.setattr(limits, "model_bytes", lambda cfg: 1 << 30)  # a 1 GiB model
    big = load_config(DIGITS, [])
    assert limits.derive_max_message_bytes(big) == limits.DEFAULT_CAP == 64 << 20
    assert limits.logical_bytes(big) == 4 * (1 << 30) + limits.MARGIN
    explicit = load_config(DIGITS, ["cluster.max_message_bytes=65536"])
    assert limits.derive_max_message_bytes(explicit) == 65536 and limits.logical_bytes(explicit) > 1 << 32
    # local steps: the leader's snapshot holds every replica's inner state too (Adam's two moments and, streaming,
    # the replica's parameters), so 8 replicas of a 1 GiB model bound a message at 4 + 8 x 3 GiB
    local = load_config(DIGITS, ["train.local_steps=5", "train.replicas=8"])
    assert limits.logical_bytes(local) == (4 + 8 * 3) * (1 << 30) + limits.MARGIN


def test_a_bad_reply_on_a_dealer_is_logged_and_dropped_and_the_next_one_read() -> None:
    """`Assembler.reply` (the step log's and the snapshot sender's reply loops): a reply that does not decode is one
    warning naming its source and None, never an exception out of the reader's loop; a good one comes back whole."""
    warnings: list[tuple[str, dict]] = []

    class Log:
        def warning(self, event: str, **kw: object) -> None:
            warnings.append((event, kw))

    ctx = zmq.Context()
    try:
        router, dealer, (ident, _) = joined_pair(ctx)
        router.send_multipart([ident, b"\x00not msgpack"])
        good = transfer.messages("snapshot", RUN, FIELDS, 1 << 30, {"a": torch.arange(4.0)})
        assert len(good) == 1
        router.send_multipart([ident, *good[0]])
        asm, got = assembly.Assembler(RUN, bound=1 << 30), []
        for _ in range(2):
            assert dealer.poll(10_000)
            got.append(asm.reply(dealer, Log(), "checkpointer"))
        assert got[0] is None and [e for e, _ in warnings] == ["bad reply from checkpointer"]
        assert got[1] is not None and torch.equal(got[1].tensors["a"], torch.arange(4.0))
    finally:
        ctx.destroy(linger=0)


def test_a_streamed_message_reuses_two_buffers_and_every_part_arrives_intact() -> None:
    """`stream` reads each part's bytes into one of two buffers, written again only once ZeroMQ is done with the part
    sent from it (its tracker): a receiver that reads slowly, with the sender's queue full, still gets every part
    bit-exact (a buffer overwritten too early would hand it the bytes of a later part)."""
    cap = 1 << 18  # parts of 256 KiB: zero-copy frames, tracked
    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(5 * cap // 4 + 7, generator=g), "b": torch.randn(cap // 8, generator=g)}
    metas, frames = protocol.encode_tensors(tensors)
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        for s in (a, b):
            s.setsockopt(zmq.SNDHWM, 1)
            s.setsockopt(zmq.RCVHWM, 1)
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        reads: list[int] = []

        def read(ti: int, off: int, out: memoryview) -> None:
            reads.append(ti)
            out[:] = frames[ti][off:off + out.nbytes]

        sent: list[int] = []
        sender = threading.Thread(target=lambda: sent.append(transfer.stream(a, "snapshot", RUN, FIELDS, metas, read,
                                                                            cap, timeout=30)))
        sender.start()
        asm, msg, parts = assembly.Assembler(RUN, bound=1 << 30), None, 0
        while msg is None:
            assert b.poll(10_000), "a part did not come"
            time.sleep(0.02)  # (a slow reader: the sender waits on its trackers meanwhile)
            msg = asm.recv(b)
            parts += 1
        sender.join(30)
        assert not sender.is_alive() and sent and parts >= 5
        for n, t in tensors.items():
            assert torch.equal(msg.tensors[n], t), n
    finally:
        ctx.destroy(linger=0)
