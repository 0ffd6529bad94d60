"""safetensors files written from byte ranges: the checkpointer's copy of `safetensors.torch.save_file`.

The format: an 8-byte little-endian header length, a JSON header `{"__metadata__": {...}, name:
{"dtype", "shape", "data_offsets": [begin, end]}, ...}` padded with spaces to a multiple of 8, then
the tensors' bytes, back to back. Written as `save_file` writes it (0.4 to 0.8): tensors ordered by
dtype (the widest first, in the order of `_ORDER`) then by name, the header's entries in that order,
compact JSON. So the files are byte for byte the ones save_file would write, except that save_file
puts the `__metadata__` keys in a random order (a Rust HashMap) and this puts them in the caller's
(tests/test_spool.py compares them). Any safetensors reader loads them.

A tensor is either in memory (a torch.Tensor) or `spool.Spooled` (runs of spool files), copied with
`os.copy_file_range` (in the kernel: no bytes through this process), or a bounded read/write loop
where the file system does not support it.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from cmemi.services.checkpointer.spool import Spooled
from cmemi.shared.wire import protocol

# wire dtype name -> safetensors', and safetensors' Dtype enum order (save_file sorts by it, widest first)
_NAMES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "float16": "F16", "bfloat16": "BF16",
          "int32": "I32", "float32": "F32", "float64": "F64", "int64": "I64"}
_ORDER = ["BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "F64", "I64"]
_COPY = 4 << 20  # bytes per copy call (and the buffer of the fallback loop)

Source = torch.Tensor | Spooled


def _entry(t: Source) -> tuple[str, list[int], int]:
    if isinstance(t, Spooled):
        return _NAMES[t.dtype], list(t.shape), t.nbytes
    name = protocol.DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"cannot write a tensor of dtype {t.dtype} (one of {sorted(_NAMES)})")
    return _NAMES[name], list(t.shape), t.numel() * t.element_size()


def header(tensors: Mapping[str, Source], metadata: dict[str, str]) -> tuple[bytes, list[str]]:
    """The file's first bytes (length + padded JSON header) and the tensor names in the order their bytes follow."""
    entries = {name: _entry(t) for name, t in tensors.items()}
    order = sorted(entries, key=lambda n: (-_ORDER.index(entries[n][0]), n))
    doc: dict[str, object] = {"__metadata__": metadata}
    at = 0
    for name in order:
        dtype, shape, nbytes = entries[name]
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def _write_all(fd: int, buf: memoryview) -> None:
    while buf.nbytes:
        buf = buf[os.write(fd, buf):]


def _copy_range(src: int, offset: int, nbytes: int, dst: int) -> None:
    """Append `nbytes` of `src` from `offset` to `dst` (at its current position)."""
    end = offset + nbytes
    try:
        while offset < end:
            n = os.copy_file_range(src, dst, min(_COPY, end - offset), offset)
            if n == 0:
                raise OSError(errno.EIO, "a spool file is shorter than its tensors")
            offset += n
        return
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    buf = memoryview(bytearray(min(_COPY, end - offset)))
    while offset < end:
        n = os.preadv(src, [buf[:min(buf.nbytes, end - offset)]], offset)
        if n == 0:
            raise OSError(errno.EIO, "a spool file is shorter than its tensors")
        _write_all(dst, buf[:n])
        offset += n


def write(path: Path, tensors: Mapping[str, Source], metadata: dict[str, str]) -> None:
    """Write a safetensors file (not fsynced: the caller does, with the rest of the checkpoint)."""
    head, order = header(tensors, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, memoryview(head))
        for name in order:
            t = tensors[name]
            if isinstance(t, Spooled):
                for e in t.extents:
                    assert e.spool.fd is not None, "a checkpoint written from a discarded spool"
                    _copy_range(e.spool.fd, e.offset, e.nbytes, fd)
            elif t.numel():
                _write_all(fd, protocol.tensor_bytes(t.detach().cpu().contiguous()))
    finally:
        os.close(fd)
