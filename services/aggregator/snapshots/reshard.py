"""Resume a checkpoint with another `cluster.shards` (docs/design.md §4, "Resharding").

The chunk grid is the model's, not K's (shared/core/grid.py), and every optimizer CMEMI allows at K > 1
keeps its state per parameter, i.e. per piece. So a checkpoint written by K shards (or one aggregator)
holds everything shard k' of K' needs, only cut differently:

- the model: whole tensors (`model.safetensors`), as at any K;
- each piece's optimizer state: taken from the old shard that owned that piece, and numbered as this
  shard's optimizer numbers its own (optimizer.param_groups included: the groups a shard has depend on
  the pieces it owns);
- the LR schedule: replayed for the checkpoint's step on this shard's optimizer (`scheduler.step()` that
  many times, as the run did: the same floats), which also sets every group's scheduled hyperparameters;
- the rest (RNG, loss scale, progress, early stopping) from the old shard 0. The byte counters of old
  shards that no longer exist go to the leader, so the run's totals stay whole.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.shared.config.plugins import param_groups
from cmemi.shared.core.grid import Partition
from cmemi.shared.wire import state

OTHER_GRID = ("the checkpoint's chunk grid is not this run's (another model.factory or model.kwargs, or "
              "compression.downlink changed to or from powersgd); resume with the settings it was trained with")


def old_shards(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The named sections (optimizer, scheduler, progress, ...) of every shard that wrote the checkpoint, in shard
    order; one aggregator's checkpoint is one shard's."""
    if "per_shard" not in meta:
        return [state.unflatten(meta, tensors)]
    out = []
    for k, shard_meta in enumerate(meta["per_shard"]):
        prefix = f"shard{k}."
        own = {n[len(prefix):]: v for n, v in tensors.items() if n.startswith(prefix)}
        out.append(state.unflatten({n: v for n, v in shard_meta.items() if n != "model"}, own))
    return out


def _numbering(trainer: Trainer, names: list[str]) -> list[str]:
    """Piece names in the order an optimizer over these pieces numbers its parameters (build_optimizer's groups;
    without optimizer.param_groups, one group in the given order)."""
    spec = getattr(trainer.cfg, trainer.optimizer_section)
    return [n for group in param_groups(spec, {n: n for n in names}) for n in group["params"]]


def _piece_states(trainer: Trainer, olds: list[dict[str, Any]], pieces: dict[str, list] | None) -> dict[str, Any]:
    """Piece name -> its optimizer state (a dict of tensors and numbers) in the checkpoint."""
    before = Partition(trainer.params, len(olds), whole=trainer.partition.whole)
    if pieces is not None and pieces != before.describe():
        raise state.StateError(OTHER_GRID)
    found: dict[str, Any] = {}
    for k, named in enumerate(olds):  # what each old shard owned (recorded since cluster.pipeline_stages)
        numbered = _numbering(trainer, named["owned"] if "owned" in named else [p.name for p in before.owned(k)])
        saved = named["optimizer"]["state"]
        for i, name in enumerate(numbered):
            piece_state = saved.get(i, saved.get(str(i)))
            if piece_state is not None:
                found[name] = piece_state
    return found


def _replay_schedule(trainer: Trainer, steps: int) -> None:
    if trainer.scheduler is None:
        return
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose, nothing is trained
        warnings.simplefilter("ignore")
        for _ in range(steps):
            trainer.scheduler.step()


def restore_into(trainer: Trainer, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load this shard's optimizer state and LR schedule from a checkpoint written with another shard count;
    returns the named sections left for `snapshots.restore` to load (rng, scaler, progress, early stopping)."""
    olds = old_shards(meta, tensors)
    found = _piece_states(trainer, olds, meta.get("pieces"))
    sd = trainer.optimizer.state_dict()  # this shard's numbering and groups, from config
    if trainer.pieces:
        for i, name in enumerate(_numbering(trainer, list(trainer.pieces))):
            if name in found:
                sd["state"][i] = found[name]
    trainer.optimizer.load_state_dict(sd)
    base = dict(olds[0])
    step = int(base["progress"]["step"])
    _replay_schedule(trainer, step)
    progress = dict(base["progress"])
    mine = olds[trainer.shard]["progress"] if trainer.shard < len(olds) else {"bytes_sent": 0, "bytes_received": 0}
    gone = olds[trainer.partition.shards:] if trainer.shard == 0 else []
    for field in ("bytes_sent", "bytes_received"):
        progress[field] = int(mine[field]) + sum(int(o["progress"][field]) for o in gone)
    base["progress"] = progress
    return base
