"""Reading a checkpoint written with another `cluster.shards` (services/aggregator/snapshots/reshard.py): every old
shard's sections come back in shard order from the checkpointer's merged form (model tensors whole, each shard's
others under `shard{k}.`, its meta in `per_shard`), and one aggregator's checkpoint reads as one shard's."""

from __future__ import annotations

import torch
from cmemi.services.aggregator.snapshots import reshard
from cmemi.shared.wire import state


def sections(k: int) -> dict:
    return {"optimizer": {"state": {0: {"exp_avg": torch.full((3,), float(k))}}, "param_groups": [{"params": [0]}]},
            "progress": {"step": 12, "bytes_in": 100 * k}}


def merged(shards: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """K snapshots as the checkpointer merges them (services/checkpointer/merge.py)."""
    per_shard, tensors = [], {"model.w": torch.zeros(2)}
    for k in range(shards):
        meta, own = state.flatten(sections(k))
        per_shard.append(meta)
        tensors.update({f"shard{k}.{n}": t for n, t in own.items()})
    return {"shards": shards, "per_shard": per_shard}, tensors


def test_every_old_shards_sections_come_back_in_shard_order() -> None:
    meta, tensors = merged(3)
    old = reshard.old_shards(meta, tensors)
    assert [s["progress"]["bytes_in"] for s in old] == [0, 100, 200]
    for k, s in enumerate(old):
        assert torch.equal(s["optimizer"]["state"][0]["exp_avg"], torch.full((3,), float(k)))


def test_one_aggregators_checkpoint_reads_as_one_shard() -> None:
    meta, tensors = state.flatten(sections(0))
    (only,) = reshard.old_shards(meta, tensors)
    assert only["progress"] == {"step": 12, "bytes_in": 0}
    assert torch.equal(only["optimizer"]["state"][0]["exp_avg"], torch.zeros(3))
