"""Datasets and models that misbehave on purpose, for the error-path tests."""

from __future__ import annotations

import sys

import torch
from cmemi.examples.digits import make_dataset
from torch.utils.data import TensorDataset


def file_dataset(path: str) -> TensorDataset:
    x, y = torch.load(path, weights_only=True)  # raises FileNotFoundError for a missing path
    return TensorDataset(x, y)


def worker_sees_other_data() -> TensorDataset:
    """Like a host with a stale copy of the data: worker w1 sees one sample changed (the run's fingerprint is the
    first admitted worker's: one of them is refused, whichever comes second)."""
    ds = make_dataset()
    if sys.argv[-2:] == ["--worker-id", "w1"]:
        x, y = ds.tensors
        x = x.clone()
        x[0, 0] += 1
        return TensorDataset(x, y)
    return ds


def slow_mlp(delay: float = 0.2, **kwargs):
    """The digits MLP; in a process with CMEMI_TEST_SLOW_WORKER=1 every forward pass takes `delay` longer,
    so that process is almost always in the middle of computing a gradient."""
    import os
    import time

    from cmemi.examples.digits import make_model

    model = make_model(**kwargs)
    if os.environ.get("CMEMI_TEST_SLOW_WORKER") == "1":
        inner = model.forward
        mark = os.environ.get("CMEMI_TEST_IN_FORWARD")  # a file that exists while a forward pass runs

        def forward(x):
            if mark:
                open(mark, "w").close()
            time.sleep(delay)
            if mark:
                os.unlink(mark)
            return inner(x)

        model.forward = forward
    return model


def paced_mlp(pace: float = 0.02, **kwargs):
    """The digits MLP (the same parameters, the same bits) whose every forward pass also takes `pace` seconds:
    a long fault run keeps the pace of a bigger model, so its faults land while it trains."""
    import time

    from cmemi.examples.digits import make_model

    model = make_model(**kwargs)
    inner = model.forward

    def forward(x):
        time.sleep(pace)
        return inner(x)

    model.forward = forward
    return model


def slow_host_mlp(pace: float = 0.02, slow: str = "w1", factor: float = 10.0, **kwargs):
    """`paced_mlp` (the same parameters, the same bits) whose forward passes take `factor` times as long in worker
    `slow` (its `--worker-id`, read at the first pass: the zygote builds the model before it knows): one host with a
    tenth of the others' compute, for the slow-host policy (tests/test_pace_cluster.py)."""
    import time

    model = paced_mlp(0.0, **kwargs)
    inner, delay = model.forward, []

    def forward(x):
        if not delay:
            argv = sys.argv
            mine = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv[:-1] else None
            delay.append(pace * factor if mine == slow else pace)
        time.sleep(delay[0])
        return inner(x)

    model.forward = forward
    return model


def poisoned_digits(index: int = 0, value: float = 1e6) -> TensorDataset:
    """The digits training set with one sample blown up: under fp16 autocast its microbatch overflows."""
    x, y = make_dataset().tensors
    x = x.clone()
    x[index] = value
    return TensorDataset(x, y)


def constant_eval(model) -> dict[str, float]:
    """An evaluation that never improves, for early-stopping tests."""
    return {"score": 1.0}


def eval_two_args(model, dataset) -> dict[str, float]:
    """A wrong evaluation signature: eval.fn is called as evaluate(model)."""
    return {"accuracy": 0.0}


class _RaisingForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom from the user's forward")


def raising_model() -> torch.nn.Module:
    return _RaisingForward()


class _Uneven(torch.utils.data.Dataset):
    """Samples of two lengths: reading one works, collating a microbatch of them fails."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        return torch.zeros(64 if i % 2 else 63), torch.tensor(i % 10)


def uneven_dataset() -> torch.utils.data.Dataset:
    return _Uneven()


def raising_eval(model) -> dict[str, float]:
    raise KeyError("no such split")


class _ManyTensors(torch.nn.Module):
    def __init__(self, n: int, size: int, **kwargs) -> None:
        from cmemi.examples.digits import make_model

        super().__init__()
        self.mlp = make_model(**kwargs)
        self.extra = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(size)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) + torch.stack(list(self.extra)).sum()


def many_tensors_mlp(n: int = 1500, size: int = 1, **kwargs) -> torch.nn.Module:
    """The digits MLP plus `n` parameters of `size` elements. With size 3,000 (18 MB, more than a flat buffer
    takes: shared/wire/layout.py) the gradient travels tensor by tensor, and its header alone is over 64 KiB."""
    return _ManyTensors(n, size, **kwargs)


def clamping_mlp(bound: float = 0.05, **kwargs) -> torch.nn.Module:
    """The digits MLP whose forward pass first clips its first layer's weights in place (a model that writes its own
    parameters: a same-host worker must copy them out of the leader's slot, never compute on read-only views)."""
    from cmemi.examples.digits import make_model

    model = make_model(**kwargs)
    first = next(model.parameters())
    inner = model.forward

    def forward(x):
        with torch.no_grad():
            first.clamp_(-bound, bound)
        return inner(x)

    model.forward = forward
    return model


class _Wrapped(torch.nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        from cmemi.examples.digits import make_model

        self.inner = make_model(**kwargs)

    def forward(self, x):
        return self.inner(x)


def wrapped_digits(**kwargs) -> torch.nn.Module:
    """The digits MLP as the submodule `inner` of a wrapper: parameters named "inner.…", as a user's wrapper names
    them (the wire's own tensors, such as a replica's inner state, must not take these frames for theirs)."""
    return _Wrapped(**kwargs)
