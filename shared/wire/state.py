"""Training state <-> (plain metadata, flat dict of tensors), for the wire and for safetensors files.

No pickle anywhere: tensors travel as raw frames / safetensors entries, everything else as msgpack/JSON.
"""

from __future__ import annotations

from typing import Any

import torch
from cmemi.shared.errors import WireError


class StateError(WireError, ValueError):
    pass


def _split(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], copy: bool) -> Any:
    """Replace every tensor inside `obj` by {"__tensor__": name}; dict keys become strings (tagged if int)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        tensors[prefix] = t.clone() if copy and t.data_ptr() == obj.data_ptr() else t
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            key = f"#int:{k}" if isinstance(k, int) else str(k)
            out[key] = _split(v, f"{prefix}.{k}", tensors, copy)
        return out
    if isinstance(obj, (list, tuple)):
        return [_split(v, f"{prefix}.{i}", tensors, copy) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise StateError(f"cannot serialise {type(obj).__name__} at {prefix!r} without pickle; "
                     "keep optimizer/scheduler state to tensors, numbers, strings and lists")


def _join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            name = obj["__tensor__"]
            if name not in tensors:
                raise StateError(f"state refers to missing tensor {name!r}")
            return tensors[name]
        return {(int(k[5:]) if k.startswith("#int:") else k): _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


def flatten(named: dict[str, Any], copy: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """{"optimizer": opt.state_dict(), ...} -> (metadata, tensors): copies, or (`copy=False`) the tensors themselves
    where they are contiguous CPU tensors already."""
    tensors: dict[str, torch.Tensor] = {}
    meta = {name: _split(value, name, tensors, copy) for name, value in named.items()}
    return meta, tensors


def unflatten(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {name: _join(value, tensors) for name, value in meta.items()}
