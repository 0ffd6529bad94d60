"""A checkpoint sent back from its files (a `restore` reply), a part at a time.

The reply is the message the checkpointer always sent: `model.`-prefixed tensors of model.safetensors,
then those of state.safetensors, each file in its own order (as `safetensors.torch.load_file` gives
them), with their xxh3 checksums in the logical header. So first one pass over the files computes the
checksums (4 MiB at a time); then `transfer.stream` cuts the message exactly as `transfer.messages`
would and reads each part's bytes with `os.preadv` just before sending it, at most two parts in
memory. The receivers need no change.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
import zmq
from cmemi.shared.errors import FaultError
from cmemi.shared.wire import transfer

_READ = 4 << 20
# safetensors' dtype names -> the wire's (protocol.DTYPES)
_WIRE = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "F16": "float16", "BF16": "bfloat16",
         "I32": "int32", "F32": "float32", "F64": "float64", "I64": "int64"}


class RestoreError(FaultError, RuntimeError):
    """A checkpoint file that verified but cannot be read as safetensors (written by something else)."""


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: list[int]
    fd: int
    offset: int  # in the file
    nbytes: int


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    while buf.nbytes:
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise OSError(errno.EIO, "a checkpoint file is shorter than its header says")
        buf, offset = buf[n:], offset + n


def _tensors(fd: int, prefix: str, path: Path) -> list[_Tensor]:
    """The tensors of a safetensors file, in the order of their bytes."""
    try:
        (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if size > 100 << 20:
            raise ValueError(f"a header of {size} bytes")
        doc = json.loads(os.pread(fd, size, 8))
        entries = sorted(((k, v) for k, v in doc.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])
        return [_Tensor(prefix + name, _WIRE[e["dtype"]], list(e["shape"]), fd, 8 + size + e["data_offsets"][0],
                        e["data_offsets"][1] - e["data_offsets"][0]) for name, e in entries]
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise RestoreError(f"{path} is not a safetensors file this checkpointer wrote: {exc}") from exc


def _checksum(t: _Tensor, buf: memoryview) -> int:
    h = xxhash.xxh3_64()
    for off in range(0, t.nbytes, buf.nbytes):
        view = buf[:min(buf.nbytes, t.nbytes - off)]
        _pread_into(t.fd, view, t.offset + off)
        h.update(view)
    return h.intdigest()


@contextmanager
def _opened(path: Path) -> Iterator[list[_Tensor]]:
    with ExitStack() as stack:
        out = []
        for name, prefix in (("model.safetensors", "model."), ("state.safetensors", "")):
            fd = os.open(path / name, os.O_RDONLY | os.O_CLOEXEC)
            stack.callback(os.close, fd)
            out += _tensors(fd, prefix, path / name)
        yield out


def wanted(meta: dict[str, Any], shards: int, header: dict[str, Any]) -> Callable[[str], bool]:
    """Which tensors a restore request (`header`: the requester's "shard" and the pieces it "owned") needs. A
    checkpoint a sharded run wrote with the same cluster.shards (`shards`), where that shard owned the same pieces:
    the model and that shard's own state (`shard{k}.`), not the other shards' (their optimizer state is 2/K of
    Adam's 2P each); anything else gets everything (reshard.py cuts it again there)."""
    shard, owned, per_shard = header["shard"], header["owned"], meta.get("per_shard")
    if (per_shard is None or meta.get("shards") != shards or not 0 <= shard < shards
            or len(per_shard) != shards or owned is None
            or not isinstance(per_shard[shard], dict) or per_shard[shard].get("owned") != owned):
        return lambda _name: True
    own = f"shard{shard}."
    return lambda name: name.startswith(("model.", own)) or not name.startswith("shard")


def send(sock: zmq.Socket, identity: bytes, run: str, fields: dict[str, Any], path: Path, cap: int,
         checksum: bool, keep: Callable[[str], bool] = lambda _name: True) -> int:
    """Send the checkpoint at `path` (the tensors `keep` keeps) as a `restore` reply to `identity`; returns the
    bytes sent. Raises `TimeoutError` if the peer stops reading, `RestoreError` if a file is not safetensors."""
    with _opened(path) as every:
        tensors = [t for t in every if keep(t.name)]
        buf = memoryview(bytearray(_READ)) if checksum else None
        metas = [{"name": t.name, "dtype": t.dtype, "shape": t.shape, "nbytes": t.nbytes,
                  "xxh": _checksum(t, buf) if buf is not None else None} for t in tensors]
        del buf

        def read(ti: int, off: int, out: memoryview) -> None:
            _pread_into(tensors[ti].fd, out, tensors[ti].offset + off)

        return transfer.stream(sock, "restore", run, fields, metas, read, cap, identity)
