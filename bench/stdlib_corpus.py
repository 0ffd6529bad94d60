"""A corpus that does not overfit within a benchmark run: the Python standard library's own sources (several MB), for
bench/local_steps.py --codecs (issue 48's quality table).

examples/charlm.py trains on 19 modules (~650 KB): a long synchronous run of its small transformer overfits that late in
the run, and a comparison at equal samples then rewards whatever trains least. Here the same model reads every `.py`
file of `sysconfig.get_paths()["stdlib"]` in sorted path order, tests and installed packages left out (test/, tests/,
idle_test/, site-packages/), each preceded by a `# ==== <path> ====` line, up to MAX_BYTES; the last HELD_OUT fraction
(whole files at the end of the order, so different modules) is held out. Deterministic for a given Python version.
`make_dataset` and `evaluate` are charlm's, on this text (`data.factory: bench.stdlib_corpus:make_dataset`,
`eval.fn: bench.stdlib_corpus:evaluate`).
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig

import torch
from cmemi.examples import charlm
from torch.utils.data import TensorDataset

MAX_BYTES = 8 << 20
HELD_OUT = 0.1
EVAL_WINDOWS = 512  # more than charlm's 128: the table compares losses within a percent
SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@functools.lru_cache(maxsize=1)
def corpus() -> bytes:
    """The concatenated sources, at most MAX_BYTES."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP)
        paths += [os.path.join(d, f) for f in files if f.endswith(".py")]
    parts, size = [], 0
    for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        with open(path, "rb") as f:
            part = f"# ==== {os.path.relpath(path, root)} ====\n".encode() + f.read() + b"\n"
        if size + len(part) > MAX_BYTES:
            break
        parts.append(part)
        size += len(part)
    if size < 1 << 20:
        raise FileNotFoundError(f"the standard library at {root} has {size} bytes of .py sources; "
                                "bench/stdlib_corpus.py needs a Python installation that ships them")
    return b"".join(parts)


@functools.lru_cache(maxsize=2)
def split_bytes(split: str) -> torch.Tensor:
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    cut = int(len(data) * (1.0 - HELD_OUT))
    return (data[:cut] if split == "train" else data[cut:]).to(torch.int64)


def make_dataset(split: str = "train", block: int = 64) -> TensorDataset:
    """TensorDataset(x, y) of non-overlapping int64 byte windows; y is x shifted left by one byte."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    w = split_bytes(split).unfold(0, block + 1, block)
    return TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous())


@functools.lru_cache(maxsize=4)
def _eval_batch(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_dataset("val", block=block).tensors
    picks = torch.linspace(0, len(x) - 1, min(EVAL_WINDOWS, len(x))).round().to(torch.int64).unique()
    return x[picks], y[picks]


def evaluate(model: torch.nn.Module) -> dict[str, float]:
    """Held-out loss (nats per byte) and bits per byte on EVAL_WINDOWS evenly spaced held-out windows."""
    value = charlm.held_out_loss(model, *_eval_batch(int(getattr(model, "block", 64))))
    return {"loss": value, "bits_per_char": value / math.log(2)}
