"""Where a worker computes: `device` from the config (auto, cpu, cuda, cuda:N), one GPU per worker."""

from __future__ import annotations

import os
import re
import zlib
from typing import Any

import torch
from cmemi.shared.errors import UserError


class DeviceError(UserError, RuntimeError):
    pass


def pick_device(setting: str, wid: str) -> torch.device:
    """`auto`: a GPU when torch sees one, else the CPU. `cuda`: this host's GPU number (the digits that end
    the worker id, e.g. w3 -> 3, modulo the GPU count), so `cmemi up`'s workers w0, w1, ... spread over the
    GPUs and a replacement takes its predecessor's; `cuda:N`: that GPU."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"config field 'device' = {setting!r}, but torch {torch.__version__} sees no CUDA GPU on "
                          "this host; install a CUDA build of torch here, or set device: cpu (or auto)")
    count = torch.cuda.device_count()
    if setting == "cuda":
        digits = re.search(r"(\d+)$", wid)
        index = int(digits.group(1)) if digits else zlib.crc32(wid.encode())
        return torch.device("cuda", index % count)
    index = int(setting.split(":", 1)[1])
    if index >= count:
        raise DeviceError(f"config field 'device' = {setting!r}, but this host has {count} GPU(s); use cuda:0.."
                          f"cuda:{count - 1} or cuda (one per worker)")
    return torch.device("cuda", index)


def make_deterministic(device: torch.device) -> None:
    """The same microbatch must give the same gradient on any worker: deterministic CUDA kernels (warning,
    not failing, for an op that has none). Must run before the first CUDA call."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a collated batch (tensors in tuples, lists, dicts) to `device`."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
