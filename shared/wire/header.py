"""The torch-free core of the wire protocol: its version and the header every message starts with.

`shared/wire/protocol.py` (tensor frames, validation) builds on it; a process that only sends header-only
messages — the coordinator's `fence` — imports this alone and never pays for importing torch. What each type's
fields are is declared in shared/wire/messages/ (torch-free too).
"""

from __future__ import annotations

from typing import Any

import msgpack

PROTOCOL_VERSION = 2  # 2: leases and gradients name a node [lo, hi) of the reduction tree


def header(mtype: str, run: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": mtype, "proto": PROTOCOL_VERSION, "run": run, **fields}


def header_only(mtype: str, run: str, fields: dict[str, Any]) -> bytes:
    """A message without tensors, as `protocol.encode` would build it: its single frame."""
    frame: bytes = msgpack.packb(header(mtype, run, fields))  # msgpack ships no annotations
    return frame
