"""Unit tests of the character-level LM example (no cluster): data, model, loss, evaluate."""

from __future__ import annotations

import math

import pytest
import torch
from cmemi.examples import charlm


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops: one intra-op thread is faster, and far faster on a loaded 2-core machine (as in the workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_dataset_is_deterministic_and_shifted():
    a = charlm.make_dataset("train", block=64)
    charlm.corpus.cache_clear()  # a genuine rebuild from the files, not the cached bytes
    charlm.split_bytes.cache_clear()
    b = charlm.make_dataset("train", block=64)
    assert len(a) == len(b) > 1000
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert ta.dtype == tb.dtype == torch.int64
        assert ta.shape == tb.shape == (len(a), 64)
        assert torch.equal(ta, tb)
    x, y = a.tensors
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte
    assert torch.equal(x[1:, 0], y[:-1, -1])  # non-overlapping windows tile the text
    assert 0 <= int(x.min()) and int(x.max()) < 256


def test_splits_options_and_errors():
    train, val = charlm.make_dataset("train"), charlm.make_dataset("val")
    assert 0 < len(val) < len(train) / 5
    x, _ = charlm.make_dataset("train", block=16, stride=8, max_windows=10).tensors
    assert x.shape == (10, 16) and torch.equal(x[0, 8:], x[1, :8])
    for kwargs in ({"split": "test"}, {"block": 0}, {"stride": 0}):
        try:
            charlm.make_dataset(**kwargs)
        except ValueError:
            continue
        raise AssertionError(f"make_dataset(**{kwargs}) did not raise")


def test_model_forward_shape_and_initial_loss():
    torch.manual_seed(0)
    model = charlm.make_model(block=64, d_model=32, n_layer=2, n_head=4)
    x, y = charlm.make_dataset("train", block=64).tensors
    logits = model(x[:3])
    assert logits.shape == (3, 64, 256)
    assert logits[:, :10].shape == model(x[:3, :10]).shape == (3, 10, 256)  # shorter sequences work
    assert abs(charlm.loss(logits, y[:3]).item() - math.log(256)) < 0.2  # near-uniform at init


def test_model_is_causal():
    torch.manual_seed(0)
    model = charlm.make_model(block=16, d_model=32).eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_forward_backward_is_deterministic():
    x, y = charlm.make_dataset("train", block=32).tensors
    grads = []
    for _ in range(2):
        torch.manual_seed(0)
        model = charlm.make_model(block=32, d_model=32, dropout=0.1)
        torch.manual_seed(1)
        charlm.loss(model(x[:4]), y[:4]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(g1, g2) for g1, g2 in zip(*grads, strict=True))


def test_a_few_steps_reduce_the_loss_and_evaluate():
    torch.manual_seed(0)
    model = charlm.make_model(block=32, d_model=32)
    x, y = charlm.make_dataset("train", block=32).tensors
    x, y = x[:16], y[:16]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = charlm.loss(model(x), y).item()
    for _ in range(30):
        opt.zero_grad()
        charlm.loss(model(x), y).backward()
        opt.step()
    last = charlm.loss(model(x), y).item()
    assert last < first - 1.0, (first, last)
    result = charlm.evaluate(model)
    assert set(result) == {"loss", "bits_per_char"}
    assert math.isfinite(result["loss"]) and result["bits_per_char"] == result["loss"] / math.log(2)
    assert model.training  # evaluate restores the mode
