"""A replica's inner optimizer and scheduler state (`train.local_steps`) on the wire: shared by the worker that computes
a round, the leader that keeps it between rounds (services/aggregator/common/replicas.py) and `cmemi reference`.

On the wire a state is shared/wire/state.py's (metadata in a header, tensors as frames named `inner.…`); `layout_of` says
which tensors a state of this model and optimizer has, so a malformed one is refused before anyone loads it.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
from cmemi.shared.config.plugins import build_optimizer, build_scheduler
from cmemi.shared.config.schema import Config
from cmemi.shared.wire import state

# {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict() or None}; streaming (train.fragments > 1)
# also "params": the replica's own parameters by tensor name, which carry on from one segment to the next; with sparse2's
# error feedback "residual": what the replica's changes have not yet sent, by tensor name (shared/compression/sparse2.py)
InnerState = dict[str, Any]

# The tensors' wire names start with ".inner.": beside a gradient's frames, which are named by the model's parameters,
# and no parameter's name starts with "." (torch refuses "." in a module's or parameter's own name). A model with a
# submodule called `inner` sends frames named "inner.…", which must stay gradients.
PREFIX = ".inner"

Signature = tuple[frozenset[tuple[str, str, tuple[int, ...]]], Any]  # tensors (name, dtype, shape); `skeleton`


def signature(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Signature:
    """What a state of one model and optimizer always has: its tensors' names, dtypes and shapes, and its metadata's
    skeleton."""
    return frozenset((n, str(t.dtype), tuple(t.shape)) for n, t in tensors.items()), skeleton(meta)


def skeleton(x: Any) -> Any:
    """Metadata with every number a placeholder (learning rates, step counts change), everything else as it is: keys,
    strings, list lengths, tensor names, and the parameter indices of each param group (which `load_state_dict`
    maps by)."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, (int, float)):
        return "<number>"
    if isinstance(x, dict):
        return {str(k): (list(v) if k == "params" and isinstance(v, (list, tuple)) else skeleton(v)) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [skeleton(v) for v in x]
    return f"<{type(x).__name__}>"


def layout_of(cfg: Config, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> Signature:
    """The signature of a replica's state after a round, for this model (`shapes`: each trained tensor's shape and
    dtype): one inner step of zeros on a stand-in, the optimizer's and scheduler's state then taken as a worker's
    sends it (through msgpack: tuples become lists)."""
    stand_in = {n: torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for n, (shape, dtype) in shapes.items()}
    opt = build_optimizer(cfg, stand_in)
    sched = build_scheduler(cfg, opt)
    for p in stand_in.values():
        p.grad = torch.zeros_like(p)
    opt.step()
    if sched is not None:
        sched.step()
    inner: InnerState = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict() if sched is not None else None}
    if cfg.train.fragments > 1:  # streaming: the replica's own parameters too
        inner["params"] = {n: p.detach() for n, p in stand_in.items()}
        inner["start"] = 1
    if cfg.compression.replica_residual:  # sparse2's residual, by parameter
        inner["residual"] = {n: torch.zeros_like(p.detach()) for n, p in stand_in.items()}
    meta, tensors = to_wire(inner)
    return signature(msgpack.unpackb(msgpack.packb(meta), strict_map_key=False), tensors)


def to_wire(inner: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata for a header, tensors named inner.…) of a replica's state; None (fresh) is an empty map."""
    if inner is None:
        return {}, {}
    meta, tensors = state.flatten({PREFIX: inner}, copy=False)
    return meta, tensors


def from_wire(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """The state `to_wire` sent (raises state.StateError when it does not hold together)."""
    if not meta:
        if tensors:
            raise state.StateError("tensors without the state they belong to")
        return None
    if set(meta) != {PREFIX}:
        raise state.StateError(f"an inner state's metadata has sections {sorted(meta)[:4]}")
    out = state.unflatten(meta, tensors)[PREFIX]
    if not isinstance(out, dict) or set(out) - {"params", "start", "residual"} != {"optimizer", "scheduler"}:
        raise state.StateError("an inner state is {optimizer, scheduler} (streaming: and params, start; sparse2: and "
                               "residual)")
    return out


def through_wire(inner: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the receiver of `inner` holds: its metadata through msgpack as a header carries it (tuples become
    lists...), its tensors copied. `cmemi reference` keeps its replicas' states this way, as the cluster does."""
    meta, tensors = to_wire(inner)
    return from_wire(msgpack.unpackb(msgpack.packb(meta), strict_map_key=False),
                     {n: t.clone() for n, t in tensors.items()})


def due(rnd: int, r: int, every: int) -> bool:
    """Whole rounds: does replica r's state after round `rnd` go up beside its change (`train.state_every` = D)? After
    round 0, always (a replay from the fresh state would need θ_0 kept for the whole run); then after rounds with
    (rnd + r) mod D = 0, staggered by replica as `fragments.ships_state` staggers streaming's snapshots, so a round's
    servers take about R / D states, not all R every D rounds. The worker sends by this rule and every server takes by
    it (a state where none is due, or none where one is, is `bad_inner`); D = 1: every round, as before issue 48."""
    return rnd == 0 or (rnd + r) % every == 0


def snapshot_start(rnd: int, r: int, every: int) -> int:
    """The round that replica r's last snapshot at the start of round `rnd` starts (0: the fresh state): the round after
    the last one before `rnd` whose state was `due`; `rnd` itself when D = 1. A worker that takes replica r at round
    `rnd` without its live state replays the rounds from there (at most D − 1 of them)."""
    return next((t + 1 for t in range(rnd - 1, -1, -1) if due(t, r, every)), 0)


# The versions a replay starts its rounds from travel beside the snapshot in its `inner` message (train.state_every >
# 1, shared/core/history.py), as tensors named ".past.<version>.<piece>": no parameter's name starts with ".", and the
# state's own are ".inner.…"
PAST = ".past."


def past_tensors(version: int, pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Version `version` of the pieces (and buffers) a round starts from, named for an `inner` message."""
    return {f"{PAST}{version}.{n}": t for n, t in pieces.items()}


def split_past(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """An `inner` message's tensors: (the state's, the past versions by version and piece name)."""
    past: dict[int, dict[str, torch.Tensor]] = {}
    for n in [n for n in tensors if n.startswith(PAST)]:
        version, name = n[len(PAST):].split(".", 1)
        past.setdefault(int(version), {})[name] = tensors.pop(n)
    return tensors, past


def owner(r: int, shards: int, placement: str) -> int:
    """The server that keeps replica r's state (`train.inner_states`): shard r mod K when spread over the shards, so
    no server's link carries more than ⌈R / K⌉ of them; the leader (shard 0) with `leader` or one server."""
    return r % shards if placement == "shards" and shards > 1 else 0


def owned(replicas: int, shard: int, shards: int, placement: str) -> list[int]:
    """The replicas whose states `shard` keeps (`owner`)."""
    return [r for r in range(replicas) if owner(r, shards, placement) == shard]
