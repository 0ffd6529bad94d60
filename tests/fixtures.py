"""Datasets and models that misbehave on purpose, for the error-path tests."""

from __future__ import annotations

import sys

import torch
from torch.utils.data import TensorDataset

from examples.digits import make_dataset


def file_dataset(path: str) -> TensorDataset:
    x, y = torch.load(path, weights_only=True)  # raises FileNotFoundError for a missing path
    return TensorDataset(x, y)


def worker_sees_other_data() -> TensorDataset:
    """Like a host with a stale copy of the data: workers see one sample changed."""
    ds = make_dataset()
    if "worker" in sys.argv:
        x, y = ds.tensors
        x = x.clone()
        x[0, 0] += 1
        return TensorDataset(x, y)
    return ds
