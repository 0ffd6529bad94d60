"""One logical checkpoint of a sharded run (cluster.shards > 1): every shard's slice of a step, merged.

Each shard sends its snapshot of a step with `shard`, `shards` and `pieces` (the chunk grid,
shared/core/grid.py) in the header; its tensors are spooled on disk (spool.py). Once all K of the same step and
term are in, they become one checkpoint: `model.safetensors` holds whole tensors (pieces joined, as runs of
their spool files: it loads without CMEMI, and
`cmemi checkpoints export` reads it as ever), the state file every shard's other tensors under
`shard{k}.`, and meta.json `{"shards": K, "pieces": ..., "per_shard": [meta of shard 0, ...]}`. Only
then is it written and `latest` moved, so a checkpoint is all K slices or nothing.

The leader names the steps every shard checkpoints (its commit), so the K slices of a step come
together. A step older than one that completed, or one that lacks shard k's slice while shard k
already sent a newer step (each shard sends its steps in order), will never be complete: it is given
up and its senders are told, so they send their next. At most `MAX_PENDING` steps wait. Every slice the
merger lets go without returning it complete (given up, replaced by a resend or by a new term's) goes to
`on_drop`, which deletes its spool file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cmemi.services.checkpointer.spool import Spooled, join

MAX_PENDING = 4


@dataclass
class Pending:
    term: int
    shards: int
    pieces: dict[str, list]
    final: bool = False
    slices: dict[int, tuple[dict[str, Any], dict[str, Spooled]]] = field(default_factory=dict)
    senders: dict[int, bytes] = field(default_factory=dict)


def sharding_problem(header: dict[str, Any]) -> str | None:
    """None if a snapshot's shard fields are well-formed (or absent: one aggregator), else what is wrong."""
    if "shards" not in header:
        return None
    shard, shards, pieces = header["shard"], header["shards"], header.get("pieces")  # (pieces: may be absent)
    if not (1 < shards <= 64 and 0 <= shard < shards):
        return f"shard {shard!r} of {shards!r}"
    if pieces is None or not all(
            isinstance(k, str) and isinstance(v, list) and len(v) == 3 and isinstance(v[0], str)
            and all(isinstance(x, int) for x in v[1:]) for k, v in pieces.items()):
        return "pieces is not a map piece -> [tensor, first row, end row]"
    return None


class Merger:
    def __init__(self, on_drop: Callable[[dict[str, Spooled]], None] = lambda tensors: None) -> None:
        self.on_drop = on_drop
        self.pending: dict[int, Pending] = {}
        self.term = -1
        self.newest: dict[int, int] = {}  # shard -> the newest step it sent in this term

    def add(self, identity: bytes, header: dict[str, Any], tensors: dict[str, Spooled]) -> tuple[
            Pending | None, list[tuple[int, list[bytes]]]]:
        """Take one shard's snapshot; returns (the step's Pending once all K are in, else None; the steps given up,
        each with the identities to tell)."""
        step, k = header["step"], header["shard"]
        if header["term"] != self.term:  # a new term (the run rolled back): its shards start over
            self.term, self.newest = header["term"], {}
        self.newest[k] = max(step, self.newest.get(k, -1))
        p = self.pending.get(step)
        if p is None or p.term != header["term"]:
            if p is not None:
                self._drop(p)
            p = self.pending[step] = Pending(header["term"], header["shards"], header["pieces"])
        if k in p.slices:  # sent again (its aggregator restarted): the newer one counts
            self.on_drop(p.slices[k][1])
        p.slices[k] = (header["meta"], tensors)
        p.senders[k] = identity
        p.final |= bool(header["final"])
        done = p if len(p.slices) == p.shards else None
        if done is not None:
            del self.pending[step]
        given_up = []
        for old in sorted(self.pending):
            q = self.pending[old]
            passed = any(j not in q.slices and self.newest.get(j, -1) > old for j in range(q.shards))
            if (done is not None and old < step) or passed or len(self.pending) > MAX_PENDING:
                del self.pending[old]
                self._drop(q)
                given_up.append((old, list(q.senders.values())))
        return done, given_up

    def _drop(self, p: Pending) -> None:
        for _, tensors in p.slices.values():
            self.on_drop(tensors)

    def clear(self) -> None:
        """Let every pending step go (the service stops)."""
        for p in self.pending.values():
            self._drop(p)
        self.pending.clear()


def merged(p: Pending) -> tuple[dict[str, Any], dict[str, Spooled]]:
    """(meta, tensors) of one checkpoint from its K slices; `ProtocolError` if their pieces do not fit together."""
    model: dict[str, Spooled] = {}
    rest: dict[str, Spooled] = {}
    per_shard = []
    for k in range(p.shards):
        meta, tensors = p.slices[k]
        per_shard.append(meta)
        for name, t in tensors.items():
            if name.startswith("model."):
                model[name[len("model."):]] = t
            else:
                rest[f"shard{k}.{name}"] = t
    whole = join(p.pieces, model)
    tensors = {**{f"model.{n}": t for n, t in whole.items()}, **rest}
    return {"shards": p.shards, "pieces": p.pieces, "per_shard": per_shard}, tensors
