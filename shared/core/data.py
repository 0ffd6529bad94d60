"""Data-sharding math: which samples form microbatch (s, m) — a pure function of (seed, epoch, s, m).

Any worker can compute any microbatch, so a microbatch whose worker died can be recomputed
elsewhere bitwise identically, and the same global batches are seen whatever the worker count.
"""

from __future__ import annotations

import functools
import hashlib
import random
from typing import Any

import numpy as np
import torch
from cmemi.shared.errors import UserError
from torch.utils.data import Dataset, default_collate


class DataError(UserError, RuntimeError):
    """The dataset cannot be read, or differs from the one the aggregator holds."""


@functools.lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randperm(n, generator=g)


def microbatch_indices(seed: int, n: int, global_batch: int, microbatches: int, step: int, m: int) -> torch.Tensor:
    """Indices of microbatch m of global step `step`. Each epoch is a fresh permutation; the tail is dropped."""
    steps_per_epoch = n // global_batch
    if steps_per_epoch == 0:
        raise DataError(f"dataset has {n} samples, fewer than train.global_batch={global_batch}; "
                        "lower train.global_batch or use a bigger dataset")
    epoch, i = divmod(step, steps_per_epoch)
    b = global_batch // microbatches
    start = i * global_batch + m * b
    return epoch_permutation(seed, epoch, n)[start:start + b]


def microbatch_seed(seed: int, step: int, m: int, stream: str = "model") -> int:
    """Seed of an RNG stream of microbatch (s, m), identical on whichever worker runs it: `data` while its
    samples are read (augmentation), `model` while it computes (dropout)."""
    key = f"{seed}/{step}/{m}" if stream == "model" else f"{seed}/{step}/{m}/{stream}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def seed_microbatch(seed: int, step: int, m: int, device: torch.device | None = None, stream: str = "model") -> None:
    """Seed every process-global RNG a dataset or model may draw from — torch (CPU, and the GPU in use),
    numpy and Python's `random` — from one stream of (seed, step, m): `data` before its samples are read,
    so random augmentation in `__getitem__` gives the same bits in whichever process reads them, then
    `model` before the forward pass, so dropout does too. Two streams, so that the data can be read in
    another process (a loader, services/worker/compute/loader.py) without changing a bit of the computation.

    These generators are process-global: nothing else may draw from them concurrently (no background
    thread reading data while the compute thread runs dropout). About 30 µs per call on a CPU.
    """
    s = microbatch_seed(seed, step, m, stream)
    # (torch.manual_seed would also queue CUDA seeding, capturing a Python stack each call: 8% of a small step)
    torch.default_generator.manual_seed(s)
    if device is not None and device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(s)
    np.random.seed(s & 0xFFFF_FFFF)  # numpy's legacy global RNG takes 32 bits
    random.seed(s)


def read_microbatch(cfg: Any, dataset: Dataset[Any], n: int, step: int, m: int) -> Any:
    """The collated samples of microbatch (step, m), read with the data stream seeded: the same bits in a
    worker, a loader process or the reference. Raises whatever the user's dataset or collate raises."""
    seed_microbatch(cfg.run.seed, step, m, stream="data")
    idx = microbatch_indices(cfg.run.seed, n, cfg.train.global_batch, cfg.train.microbatches, step, m)
    return fetch(dataset, idx)


def fetch(dataset: Dataset[Any], indices: torch.Tensor) -> Any:
    """Gather and collate the samples; TensorDataset is indexed in one go instead of item by item."""
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple) and all(isinstance(t, torch.Tensor) for t in tensors):
        return tuple(t[indices] for t in tensors)
    return default_collate([dataset[int(i)] for i in indices])


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _feed(h, o)
    elif isinstance(obj, dict):
        for k in sorted(obj):
            h.update(str(k).encode())
            _feed(h, obj[k])
    else:
        h.update(repr(obj).encode())


def fingerprint(dataset: Dataset[Any], samples: int = 256) -> dict[str, Any]:
    """Length and a content hash over `samples` evenly spaced items (all of them for small datasets)."""
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise DataError("dataset has no len(); return a map-style dataset (with __len__ and __getitem__)") from None
    h = hashlib.sha256(str(n).encode())
    picks = range(n) if n <= samples else sorted({(i * (n - 1)) // (samples - 1) for i in range(samples)})
    seed_microbatch(0, -1, 0, stream="data")  # a dataset that augments at random reads the same bits on every host
    for i in picks:
        _feed(h, dataset[i])
    if n:  # the same seeds must give the same sample, or no worker can reproduce another's microbatch
        first, again = hashlib.sha256(), hashlib.sha256()
        for digest in (first, again):
            seed_microbatch(0, -1, 0, stream="data")
            _feed(digest, dataset[picks[0]])
        if first.digest() != again.digest():
            raise DataError("dataset item 0 differs between two reads with the same seeds: its __getitem__ draws "
                            "from a random generator CMEMI does not seed (torch, numpy and random are seeded per "
                            "microbatch); draw from those, or from a generator seeded from them")
    return {"length": n, "sha256": h.hexdigest()}


def data_error(who: str, cfg: Any, exc: BaseException) -> str:
    """One line naming the process, the host, the dataset call, what it raised and where; the hint about paths
    only when a file could not be opened (anything else is the factory's own bug, and its file:line says where)."""
    import socket

    from cmemi.shared.config.usercode import describe

    hint = "; check that data.kwargs (paths) exist and are readable on this host" if isinstance(exc, OSError) else ""
    return (f"{who} on host {socket.gethostname()} cannot read the dataset: {cfg.data.factory}(**{cfg.data.kwargs}) "
            f"raised {describe(exc).line()}{hint}")
