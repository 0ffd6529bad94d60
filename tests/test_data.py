"""Data sharding: microbatch (s, m) is a pure function of (seed, epoch, s, m) and covers the data once per epoch."""

from __future__ import annotations

import torch
from cmemi.shared.core.data import fetch, fingerprint, microbatch_indices, microbatch_seed
from torch.utils.data import Dataset, TensorDataset


def test_microbatches_partition_each_epoch() -> None:
    n, B, M = 100, 20, 4
    seen = torch.cat([microbatch_indices(0, n, B, M, s, m) for s in range(5) for m in range(M)])
    assert sorted(seen.tolist()) == list(range(n))
    nxt = torch.cat([microbatch_indices(0, n, B, M, s, m) for s in range(5, 10) for m in range(M)])
    assert not torch.equal(seen, nxt)  # a fresh permutation each epoch
    assert torch.equal(microbatch_indices(0, n, B, M, 7, 2), microbatch_indices(0, n, B, M, 7, 2))
    assert not torch.equal(microbatch_indices(1, n, B, M, 0, 0), microbatch_indices(0, n, B, M, 0, 0))


def test_microbatch_seed_is_stable() -> None:
    assert microbatch_seed(0, 3, 1) == microbatch_seed(0, 3, 1) != microbatch_seed(0, 3, 2)


class ListDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i), 2.0 * i]), i % 3


def test_fetch_tensor_and_generic_datasets() -> None:
    idx = torch.tensor([3, 1])
    x, y = fetch(ListDataset(5), idx)
    assert x.shape == (2, 2) and y.tolist() == [0, 1]
    td = TensorDataset(torch.arange(10).float(), torch.arange(10))
    x, y = fetch(td, idx)
    assert x.tolist() == [3.0, 1.0]


def test_fingerprint_sees_length_and_content() -> None:
    a = fingerprint(TensorDataset(torch.arange(1000).float()))
    assert a == fingerprint(TensorDataset(torch.arange(1000).float()))
    changed = torch.arange(1000).float()
    changed[999] = -1
    assert fingerprint(TensorDataset(changed))["sha256"] != a["sha256"]
    assert fingerprint(TensorDataset(torch.arange(999).float()))["length"] == 999
