"""A tiny GPT-style character-level language model on Python's own standard-library source (no download).

Corpus: the concatenated source files of a fixed list of pure-Python standard-library modules
(`CORPUS_MODULES`: argparse, dataclasses, difflib, ...), read as raw bytes from
`sysconfig.get_paths()["stdlib"]` in that order, each preceded by a `# ==== <module> ====` line.
That is about 650 KB (655 KB on Python 3.10, 664 KB on 3.11, 686 KB on 3.12, 663 KB on 3.13).
The text is identical on every machine with the same Python version; machines with different
Python versions get different corpora, and the aggregator rejects workers whose dataset
fingerprint differs, so run the whole cluster on one Python version.

Vocabulary: the 256 byte values (no tokenizer to ship or agree on). Split: the first 90% of the
bytes train, the last 10% are held out. Samples are non-overlapping windows (stride = block by
default): x = bytes[i : i+block], y = bytes[i+1 : i+block+1], both int64 — about 9,300 training
windows of 64 bytes. `evaluate` reports the held-out loss (nats) and bits per character (byte)
on a fixed, evenly spaced subset of 128 held-out windows.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

CORPUS_MODULES: tuple[str, ...] = (
    "argparse", "dataclasses", "difflib", "textwrap", "string", "fractions", "heapq", "functools",
    "pathlib", "collections", "json.decoder", "json.encoder", "csv", "statistics", "pprint", "random",
    "contextlib", "shlex", "queue",
)
"""Standard-library modules whose source forms the corpus, in this order (single files or packages' __init__)."""

VOCAB = 256
HELD_OUT = 0.1
EVAL_WINDOWS = 128


def _module_file(stdlib: str, name: str) -> str:
    base = os.path.join(stdlib, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"the source of stdlib module {name!r} is not at {base}.py or {base}/__init__.py; "
                            "cmemi.examples.charlm needs a Python installation that ships its .py sources")


@functools.lru_cache(maxsize=1)
def corpus() -> bytes:
    """The whole corpus as bytes (deterministic for a given Python version)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in CORPUS_MODULES:
        with open(_module_file(stdlib, name), "rb") as f:
            parts.append(f"# ==== {name} ====\n".encode() + f.read())
    return b"\n".join(parts)


@functools.lru_cache(maxsize=2)
def split_bytes(split: str) -> torch.Tensor:
    """The corpus' bytes of `split` as token ids: train is all but the last HELD_OUT fraction, the rest is held out."""
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    cut = int(len(data) * (1.0 - HELD_OUT))
    return (data[:cut] if split == "train" else data[cut:]).to(torch.int64)


def _windows(split: str, block: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = split_bytes(split)
    if len(data) < block + 1:
        raise ValueError(f"the {split} split has {len(data)} bytes, fewer than block + 1 = {block + 1}")
    w = data.unfold(0, block + 1, stride)  # (N, block + 1), a view
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def make_dataset(split: str = "train", block: int = 64, stride: int | None = None,
                 max_windows: int | None = None) -> TensorDataset:
    """TensorDataset(x, y) of int64 byte windows, x:(N, block), y = x shifted left by one byte.

    split: 'train' (first 90% of the corpus) or 'val' (last 10%). stride: distance between window
    starts (default block: non-overlapping). max_windows: keep only the first this many windows.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    stride = block if stride is None else stride
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    x, y = _windows(split, block, stride)
    if max_windows is not None:
        x, y = x[:max_windows], y[:max_windows]
    return TensorDataset(x, y)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
        x = x + a
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """Token + learned position embeddings, `n_layer` causal blocks, final LayerNorm, linear LM head."""

    mask: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, vocab: int = VOCAB, block: int = 64, d_model: int = 64, n_layer: int = 2,
                 n_head: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}")
        self.vocab, self.block = vocab, block
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)
        self.drop = nn.Dropout(dropout)
        blocks = [Block(d_model, n_head, dropout) for _ in range(n_layer)]
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        # True above the diagonal = "may not attend" (future positions). Not a parameter, not saved.
        self.register_buffer("mask", torch.triu(torch.ones(block, block, dtype=torch.bool), diagonal=1),
                             persistent=False)
        self.apply(self._init)
        for blk in blocks:  # GPT-2: scale the residual projections by depth
            for proj in (blk.attn.out_proj, cast(nn.Linear, blk.mlp[2])):  # (Sequential's items are typed Module)
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.MultiheadAttention):
            nn.init.normal_(m.in_proj_weight, std=0.02)
            nn.init.zeros_(m.in_proj_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, t = x.shape
        if t > self.block:
            raise ValueError(f"sequence length {t} exceeds the model's block size {self.block}")
        h = self.drop(self.tok(x) + self.pos(torch.arange(t, device=x.device)))
        mask = self.mask[:t, :t]
        for blk in self.blocks:
            h = blk(h, mask)
        return self.head(self.ln_f(h))


def make_model(vocab: int = VOCAB, block: int = 64, d_model: int = 64, n_layer: int = 2, n_head: int = 4,
               dropout: float = 0.0) -> nn.Module:
    return CharLM(vocab=vocab, block=block, d_model=d_model, n_layer=n_layer, n_head=n_head, dropout=dropout)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all B*T positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@functools.lru_cache(maxsize=4)
def _eval_batch(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_dataset("val", block=block).tensors
    picks = torch.linspace(0, len(x) - 1, min(EVAL_WINDOWS, len(x))).round().to(torch.int64).unique()
    return x[picks], y[picks]


def evaluate(model: nn.Module) -> dict[str, float]:
    """Held-out loss (nats per byte) and bits per character on a fixed subset of the 'val' split."""
    value = held_out_loss(model, *_eval_batch(int(getattr(model, "block", 64))))
    return {"loss": value, "bits_per_char": value / math.log(2)}


def held_out_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss on (x, y) in eval mode, without gradients; the model's mode is put back after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return float(loss(model(x), y).item())
    finally:
        model.train(was_training)
