"""User code written the way plain PyTorch scripts are (tests/test_usercode.py): a module-level cache of the
text as a token tensor, a model factory that reads its vocabulary size and class weights from the data and
`torch.load`s pretrained embeddings into a cache, and a dataset that reads the same cache. Under a meta device
every one of these tensors would have no data.

CMEMI_TEST_IMPORTS / CMEMI_TEST_DATA name files where each import of this module and each call of the data
factory appends its process's pid and command line: the test reads who imported and who read the data.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset


def _note(env: str) -> None:
    if os.environ.get(env):
        with open(os.environ[env], "a") as f:
            f.write(f"{os.getpid()} {' '.join(sys.argv[1:3])}\n")


_note("CMEMI_TEST_IMPORTS")

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 30
token_cache: torch.Tensor | None = None
_pretrained: dict[str, torch.Tensor] = {}


def tokens() -> torch.Tensor:
    """The text as token ids, built on first use and cached (the usual way)."""
    global token_cache
    if token_cache is None:
        vocab = sorted(set(TEXT))
        token_cache = torch.tensor([vocab.index(c) for c in TEXT])
    return token_cache


def _windows(context: int, classes: int) -> TensorDataset:
    t = tokens()
    return TensorDataset(t.unfold(0, context, 1)[:-1].clone(), t[context:] % classes)


def train_set(context: int = 6, classes: int = 4) -> TensorDataset:
    """data.factory: windows of `context` tokens -> the next token's class."""
    _note("CMEMI_TEST_DATA")
    return _windows(context, classes)


class CharClassifier(nn.Module):
    def __init__(self, vocab: int, classes: int, context: int, prior: torch.Tensor, embedding: torch.Tensor | None):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        if embedding is not None:
            with torch.no_grad():
                self.emb.weight.copy_(embedding)
        self.body = nn.Linear(8 * context, 16)
        self.head = nn.Linear(16, classes)
        self.register_buffer("log_prior", prior)  # a buffer filled from the data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.emb(x).flatten(1)))) + self.log_prior


def model(context: int = 6, classes: int = 4, embedding: str | None = None) -> CharClassifier:
    """model.factory: the vocabulary size and the class prior come from the data; `embedding` is a torch.save'd
    tensor of pretrained embeddings, loaded into a cache."""
    vocab = int(tokens().max()) + 1
    labels = _windows(context, classes).tensors[1]
    prior = (torch.bincount(labels, minlength=classes).float() + 1).log()
    if embedding is not None and embedding not in _pretrained:
        _pretrained[embedding] = torch.load(embedding, weights_only=True)
    return CharClassifier(vocab, classes, context, prior, _pretrained.get(embedding) if embedding else None)
