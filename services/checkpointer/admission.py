"""What the checkpointer accepts: only the current aggregator term's snapshots, with a well-formed meta.

- `TermWatch`: the current term is the aggregator's term counter in Redis (`keys.term`, allocated
  by each aggregator at start). It is cached, and read again whenever a message names another term,
  so a new aggregator is recognised at its first snapshot; while Redis is away, only the last term
  read is accepted (a term can only be allocated through Redis, so no newer real one can exist).
- `meta_problem`: the snapshot's meta must be what `state.flatten` makes — JSON values only (no
  bytes, no NaN keys), bounded depth, the expected top-level sections, every tensor it references
  present, and its progress agreeing with the header (step within the run, same term). A malformed
  one is dropped and counted, never written, never a crash.
"""

from __future__ import annotations

import math
from typing import Any

import redis
from cmemi.shared.coordination.keys import Keys

SECTIONS = {"model", "optimizer", "scheduler", "rng", "scaler", "progress"}
# the final snapshot carries the run's summary; early stopping its state; a sharded run's the pieces each shard owns
# history: train.state_every > 1's versions a replay starts from (shared/core/history.py)
OPTIONAL = {"summary", "early_stop", "owned", "downlink", "inner", "history"}  # downlink: compression.downlink's mirror; inner: train.local_steps' replicas
PROGRESS: dict[str, type | tuple[type, ...]] = {"step": int, "term": int, "final_loss": (int, float), "bytes_sent": int, "bytes_received": int,
            "fingerprint": dict, "skipped": int, "wall_s": (int, float)}
MAX_DEPTH = 32


class TermWatch:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self.term: int | None = None
        self.unsure = False  # the last check could not read the term (Redis away, or restarted empty)

    def current(self, claimed: int) -> bool:
        """Is `claimed` the current aggregator term?"""
        if claimed == self.term:
            return True
        try:  # Redis restarted empty: the running aggregator re-advertises its term within a second
            value = self.client.get(self.keys.term) or self.client.hget(self.keys.aggregator, "term")
        except redis.RedisError:
            self.unsure = True
            return False  # Redis away: only the cached term counts
        self.term = int(value) if value is not None else None
        self.unsure = self.term is None
        return claimed == self.term


def _json_problem(obj: Any, depth: int, tensors: dict[str, Any], path: str) -> str | None:
    if depth > MAX_DEPTH:
        return f"{path}: nested deeper than {MAX_DEPTH}"
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            name = obj["__tensor__"]
            return None if isinstance(name, str) and name in tensors else f"{path}: refers to a missing tensor"
        for k, v in obj.items():
            if not isinstance(k, str):
                return f"{path}: a key of type {type(k).__name__}"
            if (why := _json_problem(v, depth + 1, tensors, f"{path}.{k[:40]}")) is not None:
                return why
        return None
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            if (why := _json_problem(v, depth + 1, tensors, f"{path}[{i}]")) is not None:
                return why
        return None
    if obj is None or isinstance(obj, (bool, int, str)):
        return None
    if isinstance(obj, float):
        return None  # NaN/inf are valid JSON for Python's json (a diverged loss), and read back the same
    return f"{path}: a value of type {type(obj).__name__}"


def meta_problem(header: dict[str, Any], tensors: dict[str, Any], total_steps: int) -> str | None:
    """None if the snapshot's meta is well-formed, else what is wrong with it (one line)."""
    meta = header["meta"]
    keys = set(meta)
    if not SECTIONS <= keys or not keys <= SECTIONS | OPTIONAL:
        return f"meta sections {sorted(map(str, keys))[:10]}, expected {sorted(SECTIONS)}"
    if (why := _json_problem(meta, 0, tensors, "meta")) is not None:
        return why
    progress = meta["progress"]
    if not isinstance(progress, dict):
        return "meta.progress is not a map"
    for name, types in PROGRESS.items():
        value = progress.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            return f"meta.progress.{name} missing or of type {type(value).__name__}"
    if progress["step"] != header["step"] or progress["term"] != header["term"]:
        return "meta.progress disagrees with the header's step or term"
    if not 0 <= header["step"] <= total_steps:
        return f"step {header['step']} outside the run's 0..{total_steps}"
    if isinstance(progress["wall_s"], float) and not math.isfinite(progress["wall_s"]):
        return "meta.progress.wall_s is not finite"
    return None
