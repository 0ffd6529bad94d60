"""`model.init_from` on a Hugging Face `save_pretrained` directory: sharded safetensors and tied weights.

Why its own module: initweights.py reads one file and checks names; a `save_pretrained` directory differs in two
ways that need nothing from `transformers` itself, so they are read here with safetensors alone:
- sharded: past `max_shard_size` the weights are split over model-0000K-of-0000N.safetensors files, and
  model.safetensors.index.json maps each name to its shard (`weight_map`); every name the index lists must
  be in its shard, or the directory is damaged (a shard copied half-way).
- tied: a tensor the model holds under two names (GPT-2's `lm_head.weight` is `transformer.wte.weight`) is
  written once, under one of them. The model's state_dict still lists both; a name missing from the file is
  not missing when another name of the same tensor is there (same storage, shape, strides and dtype):
  loading that one fills both. A genuinely missing tensor still fails by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

INDEX = "model.safetensors.index.json"


def index_file(directory: Path) -> Path | None:
    """The shard index of a sharded `save_pretrained` directory, or None."""
    f = directory / INDEX
    return f if f.is_file() else None


def read_sharded(index: Path) -> dict[str, torch.Tensor]:
    """Every tensor the index names, read from its shard (each shard once, in name order); ValueError names a
    name its shard lacks or a shard that is not there."""
    from safetensors.torch import load_file

    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index.name} has no 'weight_map' of tensor name -> shard file")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        path = index.parent / shard
        if not path.is_file():
            raise ValueError(f"shard {shard} named by {index.name} is not in {index.parent}")
        tensors = load_file(str(path))
        wanted = sorted(n for n, s in weight_map.items() if s == shard)
        lost = [n for n in wanted if n not in tensors]
        if lost:
            raise ValueError(f"shard {shard} lacks {len(lost)} names {index.name} puts there (first: {lost[0]})")
        out.update({n: tensors[n] for n in wanted})
    return out


def tied_names(state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """name -> the other names of the same tensor in `state` (a model's state_dict), for tensors held twice."""
    groups: dict[tuple[int, tuple[int, ...], tuple[int, ...], str], list[str]] = {}
    for name, t in state.items():
        if t.numel():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
            groups.setdefault(key, []).append(name)
    return {n: [o for o in names if o != n] for names in groups.values() if len(names) > 1 for n in names}


def covered(name: str, tied: dict[str, list[str]], loaded: dict[str, torch.Tensor]) -> str | None:
    """The name under which `loaded` holds the tensor of `name` (itself or a tied name), or None."""
    if name in loaded:
        return name
    return next((o for o in tied.get(name, []) if o in loaded), None)
