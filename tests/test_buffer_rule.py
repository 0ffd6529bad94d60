"""The buffer rule (shared/buffers.py) and the pieces around it, without processes."""

from __future__ import annotations

import random

import numpy as np
import torch
from cmemi.services.aggregator.collector import StepCollector
from cmemi.shared import buffers
from cmemi.shared.data import fingerprint, seed_microbatch
from cmemi.shared.environment import differences
from cmemi.shared.reduction import tree_reduce


def test_floating_buffers_are_the_tree_mean_and_counters_advance_by_M() -> None:
    M = 5
    bn = torch.nn.BatchNorm1d(3)
    live = buffers.travelling(bn)
    assert set(live) == {"running_mean", "running_var", "num_batches_tracked"}
    start = {n: b.clone() for n, b in live.items()}
    produced = []
    for m in range(M):
        with torch.no_grad():
            for n, b in live.items():
                b.copy_(start[n])
        bn(torch.randn(8, 3) * (m + 1))
        produced.append({n: b.clone() for n, b in live.items()})
    c = StepCollector(0, M)
    for m in (3, 0, 4, 1, 2):  # any arrival order
        c.offer(m, {"g": torch.ones(1)}, 0.0, buffers.contribution(start, {n: t.clone() for n, t in produced[m].items()}))
    with torch.no_grad():  # the aggregator's model never runs forward: its buffers are the step's start
        for n, b in live.items():
            b.copy_(start[n])
    buffers.fold(live, c.buffer_sum(), M)
    want = tree_reduce([p["running_var"] for p in produced], lambda a, b: a + b) / M
    assert torch.equal(bn.running_var, want)
    assert int(bn.num_batches_tracked) == M  # as one process accumulating M microbatches


def test_a_model_without_buffers_has_nothing_to_travel() -> None:
    assert buffers.travelling(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())) == {}


def test_every_global_rng_is_seeded_per_microbatch() -> None:
    def draw() -> tuple[float, float, float]:
        return torch.rand(1).item(), float(np.random.rand()), random.random()

    seed_microbatch(7, 3, 1)
    a = draw()
    seed_microbatch(7, 3, 2)
    b = draw()
    seed_microbatch(7, 3, 1)
    assert draw() == a and a != b


def test_a_dataset_drawing_from_an_unseeded_generator_is_refused() -> None:
    rng = np.random.default_rng()

    class Unseeded(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int):
            return torch.tensor(rng.random()), torch.tensor(0)

    try:
        fingerprint(Unseeded())
    except RuntimeError as exc:
        assert "does not seed" in str(exc)
    else:
        raise AssertionError("an unseeded generator went unnoticed")


def test_environment_differences_are_named() -> None:
    want = {"torch": "2.1", "threads": "1", "cpu": "AVX2"}
    assert differences(dict(want), want, tuple(want)) == []
    diff = differences({**want, "cpu": "AVX512"}, want, tuple(want))
    assert diff == ["cpu AVX512 (expected AVX2)"]
    assert differences(None, want, tuple(want))[0].startswith("no environment")
