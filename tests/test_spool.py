"""Streaming checkpoints (services/checkpointer/spool.py, safetensors_out.py, restore.py): snapshots go to disk
as their parts arrive, the checkpoint files are the ones `safetensors.torch.save_file` writes, a bad part drops
its transfer and its spool file, and a restore read back from the files is the message the checkpointer always
sent. Fast: no processes; real sockets for the restore."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
import zmq
from cmemi.services.checkpointer import restore, spool
from cmemi.services.checkpointer.merge import Merger, merged
from cmemi.services.checkpointer.spool import Spool
from cmemi.services.checkpointer.store import CheckpointStore
from cmemi.shared.core.grid import Partition
from cmemi.shared.wire import assembly, protocol, transfer
from cmemi.shared.wire.protocol import ProtocolError
from safetensors.torch import load_file, save_file

from tests.helpers.sockets import joined_pair

RUN = "r1"
CAP = 1 << 16
STEP = 7


def tensors_of_every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(5 * CAP // 4 + 3, generator=g),  # several chunks
        "model.b": torch.randn(3000, generator=g).to(torch.bfloat16),
        "model.empty": torch.zeros(0, 4),
        "model.a_f16": torch.randn(33, generator=g).half(),
        "optimizer.state.0.exp_avg": torch.randn(100, 7, generator=g, dtype=torch.float64),
        "optimizer.state.0.step": torch.tensor(3.0),
        "rng.torch": torch.arange(256, dtype=torch.uint8),
        "x.i64": torch.arange(20000),
        "x.i32": torch.arange(50, dtype=torch.int32),
        "x.i16": torch.arange(50, dtype=torch.int16),
        "x.i8": torch.arange(50, dtype=torch.int8),
        "x.bool": torch.arange(99) % 3 == 0,
    }


def old_files(tensors: dict[str, torch.Tensor], step: int, into: Path) -> Path:
    """What the checkpointer wrote before streaming: safetensors.torch.save_file of the tensors in memory."""
    into.mkdir()
    save_file({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, str(into / "model.safetensors"),
              metadata={"format": "pt", "step": str(step)})
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.")}, str(into / "state.safetensors"),
              metadata={"step": str(step)})
    return into


def same_bytes(new: Path, old: Path) -> None:
    """Byte for byte, except the order of the `__metadata__` keys, which save_file leaves to a Rust HashMap."""
    a, b = new.read_bytes(), old.read_bytes()
    n = struct.unpack("<Q", a[:8])[0]
    assert struct.unpack("<Q", b[:8])[0] == n and len(a) == len(b)
    meta_a = json.loads(a[8:8 + n])["__metadata__"]
    span = re.search(rb'"__metadata__":(\{[^}]*\})', b[:8 + n])
    assert span is not None and json.loads(span.group(1)) == meta_a
    b = b[:span.start(1)] + json.dumps(meta_a, separators=(",", ":")).encode() + b[span.end(1):]
    assert a == b, f"{new.name} differs from save_file's"


def spooled(root: Path, header: dict, msgs: list[list], peer: bytes = b"p",
            drops: list[str] | None = None) -> protocol.Message | None:
    """The snapshot `msgs` received by an Assembler whose sink is a spool file under `root`."""
    def sink(of: dict, metas: list[dict]) -> Spool:
        return Spool(root, of["step"], of.get("shard", 0), metas, lambda exc, attempt: None)

    seen = drops if drops is not None else []
    asm = assembly.Assembler(RUN, 1 << 30, sink=sink, on_abandon=lambda reason, detail: seen.append(reason))
    out = None
    for m in msgs:
        out = asm.decode(peer, [bytes(f) for f in m])
    return out


def snapshot(tensors: dict[str, torch.Tensor], **fields) -> list[list]:
    return transfer.messages("snapshot", RUN, {"step": STEP, "term": 1, "final": False, "meta": {}, **fields}, CAP,
                             tensors)


@pytest.mark.parametrize("cap", [CAP, 1 << 30], ids=["parts", "whole"])
def test_streamed_checkpoint_files_are_byte_identical_to_save_files(tmp_path: Path, cap: int) -> None:
    tensors = tensors_of_every_dtype()
    msgs = transfer.messages("snapshot", RUN, {"step": STEP, "term": 1, "final": False, "meta": {}}, cap, tensors)
    assert (len(msgs) > 3) == (cap == CAP)
    store = CheckpointStore(tmp_path / "ckpt")
    msg = spooled(store.root, {}, msgs)
    assert msg is not None and len(list(store.root.glob(".tmp-spool-*"))) == 1
    assert all(isinstance(t, spool.Spooled) for t in msg.tensors.values())
    path = store.write(STEP, {"m": 1}, msg.tensors)
    spool.discard(msg.tensors)
    assert not list(store.root.glob(".tmp-*"))
    old = old_files(tensors, STEP, tmp_path / "old")
    for name in ("model.safetensors", "state.safetensors"):
        same_bytes(path / name, old / name)
    assert store.verify(path) is None
    # and from tensors in memory (bench/checkpoint.py, tools)
    again = CheckpointStore(tmp_path / "mem").write(STEP, {"m": 1}, tensors)
    for name in ("model.safetensors", "state.safetensors"):
        same_bytes(again / name, old / name)


def test_a_sharded_snapshot_merges_to_the_files_of_the_whole_model(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    params = {"0.weight": torch.randn(300, 64, generator=g), "0.bias": torch.randn(300, generator=g),
              "2.weight": torch.randn(10, 300, generator=g)}
    part = Partition(params, shards=2)
    assert part.split and part.owned(0) and part.owned(1)
    store = CheckpointStore(tmp_path / "ckpt")
    merger = Merger(spool.discard)
    expected_state: dict[str, torch.Tensor] = {}
    done = None
    for k in (1, 0):  # any order
        views = part.views(params, k)
        mine = {f"model.{n}": v for n, v in views.items()}
        mine.update({f"optimizer.{n}.exp_avg": v * 0.5 for n, v in views.items()})
        expected_state.update({f"shard{k}.optimizer.{n}.exp_avg": v * 0.5 for n, v in views.items()})
        header = {"step": STEP, "term": 1, "final": False, "meta": {"k": k}, "shard": k, "shards": 2,
                  "pieces": part.describe()}
        msg = spooled(store.root, header, transfer.messages("snapshot", RUN, header, 4096, mine), peer=bytes([k]))
        assert msg is not None
        done, given_up = merger.add(bytes([k]), msg.header, msg.tensors)
        assert given_up == []
    assert done is not None and len(list(store.root.glob(".tmp-spool-*"))) == 2
    meta, tensors = merged(done)
    path = store.write(STEP, meta, tensors)
    for _, t in done.slices.values():
        spool.discard(t)
    assert not list(store.root.glob(".tmp-*"))
    old = old_files({**{f"model.{n}": p for n, p in params.items()}, **expected_state}, STEP, tmp_path / "old")
    for name in ("model.safetensors", "state.safetensors"):
        same_bytes(path / name, old / name)
    assert json.loads((path / "meta.json").read_text())["per_shard"] == [{"k": 0}, {"k": 1}]


def test_a_corrupted_part_drops_its_transfer_and_its_spool(tmp_path: Path) -> None:
    tensors = tensors_of_every_dtype()
    msgs = [[bytes(f) for f in m] for m in snapshot(tensors)]
    bad = bytearray(msgs[1][1])
    bad[5] ^= 0xFF
    msgs[1][1] = bytes(bad)
    drops: list[str] = []
    with pytest.raises(ProtocolError) as exc:
        spooled(tmp_path, {}, msgs, drops=drops)
    assert exc.value.reason == "bad_checksum" and drops == ["transfer_abandoned"]
    assert not list(tmp_path.glob(".tmp-*")), "the spool of a dropped transfer is deleted"


def test_given_up_and_replaced_slices_delete_their_spools(tmp_path: Path) -> None:
    merger = Merger(spool.discard)
    t = {"model.w": torch.ones(10)}
    pieces = {"w": ["w", 0, 10]}

    def slice_of(step: int, k: int) -> None:
        header = {"step": step, "term": 1, "final": False, "meta": {}, "shard": k, "shards": 2, "pieces": pieces}
        msg = spooled(tmp_path, header, transfer.messages("snapshot", RUN, header, CAP, t))
        assert msg is not None
        merger.add(bytes([k]), msg.header, msg.tensors)

    slice_of(10, 0)
    slice_of(10, 0)  # sent again: the first one's spool goes
    assert len(list(tmp_path.glob(".tmp-spool-*"))) == 1
    slice_of(20, 0)
    slice_of(20, 1)  # step 20 complete: step 10 will never be
    assert sorted(p.name.split("-")[2] for p in tmp_path.glob(".tmp-spool-*")) == ["00000020", "00000020"]
    merger.clear()  # what is left when the service stops... except a step returned complete, the caller's
    store = CheckpointStore(tmp_path)
    assert len(store.clean_leftovers()) == 2 and not list(tmp_path.glob(".tmp-*"))


def restored(path: Path, fields: dict, cap: int, count: int, **kw) -> tuple[int, list[list[bytes]]]:
    """The checkpoint at `path` sent by restore.send over real sockets: (bytes sent, the `count` messages received;
    no more come)."""
    ctx = zmq.Context()
    try:
        router, dealer, (identity, _) = joined_pair(ctx, b"hi")
        sent = restore.send(router, identity, RUN, fields, path, cap, checksum=True, **kw)
        got = []
        while len(got) < count:
            assert dealer.poll(10_000), "the restore did not arrive"
            got.append(dealer.recv_multipart())
        assert not dealer.poll(100)
        return sent, got
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("cap", [CAP, 1 << 30], ids=["parts", "whole"])
def test_a_restore_read_from_the_files_is_the_message_sent_before(tmp_path: Path, cap: int) -> None:
    tensors = tensors_of_every_dtype()
    store = CheckpointStore(tmp_path)
    path = store.write(STEP, {"m": [1, 2]}, tensors)
    meta, loaded = store.load(path)
    fields = {"step": STEP, "meta": meta}
    before = transfer.messages("restore", RUN, fields, cap, loaded)
    sent, got = restored(path, fields, cap, len(before))
    assert sent == sum(protocol.message_bytes(m) for m in before)
    xfer = re.compile(rb"\xa4xfer\xcf.{8}|\xa4xfer\xd3.{8}", re.S)  # the transfer id is random: compare the rest
    for a, b in zip(got, before, strict=True):
        assert xfer.sub(b"", a[0]) == xfer.sub(b"", bytes(b[0])) and a[1:] == [bytes(f) for f in b[1:]]
    msg = None
    asm = assembly.Assembler(RUN, 1 << 30)
    for m in got:
        msg = asm.decode(b"", m)
    assert msg is not None and msg.type == "restore" and list(msg.tensors) == list(loaded)
    assert all(torch.equal(msg.tensors[n], loaded[n]) for n in loaded)
    assert list(load_file(str(path / "model.safetensors"))) == [n[6:] for n in loaded if n.startswith("model.")]


def test_a_sharded_restore_sends_a_shard_the_model_and_its_own_state_only(tmp_path: Path) -> None:
    """The other shards' optimizer state stays on disk when the requester owns what its shard owned then; any
    other requester (another cluster.shards, other pieces, an unsharded checkpoint) gets everything to cut again."""
    tensors = {"model.w": torch.ones(8, 4), "shard0.optimizer.state.#int:0.exp_avg": torch.zeros(4, 4),
               "shard1.optimizer.state.#int:0.exp_avg": torch.ones(4, 4), "shard10.x": torch.ones(2)}
    meta = {"shards": 2, "per_shard": [{"owned": ["w#0"]}, {"owned": ["w#1"]}]}
    keep = restore.wanted(meta, 2, {"shard": 1, "owned": ["w#1"]})
    assert [n for n in tensors if keep(n)] == ["model.w", "shard1.optimizer.state.#int:0.exp_avg"]
    # headers as protocol.decode fills them (restore_req: an absent shard reads 0, an absent owned None)
    for header, shards in (({"shard": 1, "owned": ["w#0"]}, 2), ({"shard": 1, "owned": ["w#1"]}, 3),
                           ({"shard": 1, "owned": None}, 2), ({"shard": 5, "owned": ["w#1"]}, 2),
                           ({"shard": 0, "owned": ["w#1"]}, 2)):
        assert all(restore.wanted(meta, shards, header)(n) for n in tensors), header
    assert all(restore.wanted({"m": 1}, 2, {"shard": 1, "owned": ["w#1"]})(n) for n in tensors)
    path = CheckpointStore(tmp_path).write(STEP, meta, tensors)
    _, got = restored(path, {"step": STEP, "meta": meta}, 1 << 30, 1, keep=keep)
    msg = assembly.Assembler(RUN, 1 << 30).decode(b"", got[0])
    assert msg is not None and sorted(msg.tensors) == ["model.w", "shard1.optimizer.state.#int:0.exp_avg"]
    assert torch.equal(msg.tensors["shard1.optimizer.state.#int:0.exp_avg"], torch.ones(4, 4))
