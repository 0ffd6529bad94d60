"""What a snapshot of the aggregator's training state holds, and how a checkpoint's comes back.

`collect` names every section a run needs to continue bitwise identically (model, optimizer, scheduler, RNG,
scaler, progress, early stopping, and the sharded, downlink and local-steps sections) without copying a tensor;
`restore` loads them back, cutting a checkpoint of another `cluster.shards` again for this one (reshard.py).
Sending a snapshot is the link's job (send.py); here is only what it contains.
"""

from __future__ import annotations

from typing import Any

import torch
from cmemi.services.aggregator.common import dataprint
from cmemi.services.aggregator.common.evaluation import BackgroundEval
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.snapshots import reshard
from cmemi.shared.errors import WireError
from cmemi.shared.wire import state

Snapshot = tuple[int, dict[str, Any], dict[str, torch.Tensor]]
# A checkpoint that does not fit this run: the wire tree's (StateError), or what torch's load_state_dict and a
# missing section raise. The aggregator stops with it as a fatal error: restarting would read the same checkpoint.
NOT_RESTORABLE = (WireError, KeyError, RuntimeError, ValueError)


def collect(trainer: Trainer, totals: RunTotals, term: int, fp: dict[str, Any],
            bg_eval: BackgroundEval | None, evaluating: int | None = None) -> Snapshot:
    """Everything needed to continue the run bitwise identically, naming the live tensors (the link copies what
    is not sent yet before the next step changes them: `CheckpointerLink.protect`). An evaluation of an earlier step must not be running (its weights are not in the snapshot): settle it first.
    `evaluating`: the step of an evaluation not started yet (sharded: it waits for the other shards' slices), to
    run again after a restore like one in flight."""
    t = trainer
    named: dict[str, Any] = {
        "model": _model_section(t),
        "optimizer": t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict() if t.scheduler is not None else None,
        "rng": {"torch": torch.get_rng_state()},
        "scaler": t.scaler.state_dict(),
        "progress": {"step": t.step, "term": term, "fingerprint": fp, "skipped": t.skipped, **totals.state_dict()},
        # early stopping: history, best, patience counter, and the evaluation in flight (of this step's weights)
        "early_stop": ({**bg_eval.state_dict(), **({"running": evaluating} if evaluating is not None else {})}
                       if bg_eval is not None else None),
        # sharded: the pieces this shard owns (who owns what depends on cluster.pipeline_stages too: reshard.py)
        **({"owned": list(t.pieces)} if t.sharded else {}),
        # compression.downlink: the workers' mirror of these pieces and the downlink codec's state (shared/compression/downlink.py)
        **({"downlink": t.mirror.state_dict()} if t.mirror is not None else {}),
        # train.local_steps: the inner optimizer and scheduler state at the round's start of every replica this server
        # keeps (the leader: all, or with train.inner_states: shards, each shard its replicas r mod K)
        **({"inner": t.inner.state_dict()} if t.inner is not None else {}),
        # train.state_every > 1: the versions a replay may start from (shared/core/history.py), so that a restored
        # server answers a moved replica's replay as the one it replaces would (docs/design/local-steps.md)
        **({"history": t.history.state_dict()} if t.history.on else {}),
    }
    meta, tensors = state.flatten(named, copy=False)
    return t.step, meta, tensors


def _model_section(t: Trainer) -> dict[str, torch.Tensor]:
    """The model's state; of a sharded run, this shard's pieces by piece name (shard 0: with the entries that are
    not trained: buffers, frozen tensors). The checkpointer joins every shard's into one model.safetensors."""
    if not t.sharded:
        return t.model.state_dict()
    section = {n: p.detach() for n, p in t.pieces.items()}
    if t.shard == 0:
        section.update({n: v for n, v in t.model.state_dict().items() if n not in t.params})
    return section


def _sections(trainer: Trainer, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[
        dict[str, Any], dict[str, Any], bool]:
    """(this shard's sections, the whole model's state, whether they were written with another cluster.shards).
    The checkpointer merged a sharded run's K snapshots into one: model tensors whole, every shard's other tensors
    under `shard{k}.`, its meta in `per_shard`."""
    model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    if "per_shard" not in meta:  # written by one aggregator
        named = state.unflatten(meta, tensors)
        groups = named.get("optimizer", {}).get("param_groups", [])
        if not trainer.sharded and sum(len(g.get("params", [])) for g in groups) not in (0, len(trainer.pieces)):
            raise state.StateError(reshard.OTHER_GRID)  # pieces stepped then are not this run's
        return named, named["model"], trainer.sharded
    if int(meta["shards"]) != trainer.partition.shards:
        return {}, model, True
    prefix = f"shard{trainer.shard}."
    own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    mine = state.unflatten({k: v for k, v in meta["per_shard"][trainer.shard].items() if k != "model"}, own)
    if mine.get("owned", list(trainer.pieces)) != list(trainer.pieces):  # the same K, pipelined or not
        return {}, model, True
    return mine, model, False


def restore(trainer: Trainer, totals: RunTotals, fp: dict[str, Any] | None, bg_eval: BackgroundEval | None,
            meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """`fp`: the run's dataset fingerprint, filled from the checkpoint's when empty, else checked against it (None:
    not checked, a shard k > 0 holds none; the leader does, services/aggregator/common/dataprint.py). A checkpoint of another cluster.shards is cut again for this one (reshard.py)."""
    named, model, other_k = _sections(trainer, meta, tensors)
    t = trainer
    t.model.load_state_dict(model)
    if other_k:
        named = reshard.restore_into(t, meta, tensors)
    else:
        t.optimizer.load_state_dict(named["optimizer"])
        if t.scheduler is not None and named["scheduler"] is not None:
            t.scheduler.load_state_dict(named["scheduler"])
    if fp is not None and not dataprint.adopt(fp, named["progress"]["fingerprint"]):
        raise state.StateError("the checkpoint was written for a different dataset (fingerprint differs); "
                               "restore with the data it was trained on, or start a new run.dir")
    torch.set_rng_state(named["rng"]["torch"])
    t.scaler.load_state_dict(named["scaler"])
    t.step = int(named["progress"]["step"])
    t.skipped = int(named["progress"]["skipped"])
    totals.load_state_dict(named["progress"])
    if t.mirror is not None:
        _restore_mirror(t, named.get("downlink") if not other_k else _merged_mirrors(meta, tensors))
    if t.inner is not None:
        t.inner.load_state_dict(named.get("inner") if not other_k else _merged_inner(meta, tensors))
    if t.history.on:  # each server its own pieces of the versions (another cluster.shards': cut again)
        t.history.load_state_dict(named.get("history") if not other_k else _merged_history(t, meta, tensors))
        t.history.keep(t.step, t.wire_state())
    early = named.get("early_stop")
    if bg_eval is not None and early is not None:
        bg_eval.load_state_dict(early)
        if early["running"] is not None and int(early["running"]) == t.step:  # it was lost with the old term
            bg_eval.start(t.step, {k: v.clone() for k, v in t.model.state_dict().items()})


def _merged_inner(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[Any, Any]:
    """Every old shard's replicas' states in one (a checkpoint of another cluster.shards: with `train.inner_states:
    shards` each shard kept its replicas', r mod K; the leader's alone held all); each server keeps its own of them."""
    return {r: s for named in reshard.old_shards(meta, tensors) for r, s in (named.get("inner") or {}).items()}


def _merged_history(t: Trainer, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[int, Any]:
    """Every old shard's pieces of each kept version in one, only this server's kept (a checkpoint of another
    cluster.shards: the grid's pieces are K's alike, the step's buffers shard 0's)."""
    own, merged = set(t.wire_state()), dict[int, dict[str, torch.Tensor]]()
    for named in reshard.old_shards(meta, tensors):
        for v, pieces in (named.get("history") or {}).items():
            merged.setdefault(int(v), {}).update({n: x for n, x in pieces.items() if n in own})
    return merged


def _merged_mirrors(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """Every old shard's downlink section in one (a checkpoint of another cluster.shards: pieces are K's alike)."""
    found = [named["downlink"] for named in reshard.old_shards(meta, tensors) if named.get("downlink") is not None]
    if not found:
        return None
    return {part: {n: t for sd in found for n, t in (sd.get(part) or {}).items()} for part in ("mirror", "codec")}


def _restore_mirror(t: Trainer, sd: dict[str, Any] | None) -> None:
    """The workers' mirror as the checkpoint holds it; a checkpoint written without compression.downlink holds none:
    the mirror starts from the restored parameters, as a fresh run's does."""
    if sd is None:
        t.mirror.reset(t.pieces, t.step)  # type: ignore[union-attr]
    else:
        t.mirror.load_state_dict(sd, t.step)  # type: ignore[union-attr]
