"""A small causal language model built by Hugging Face `transformers`, with a BPE tokenizer trained here by
`tokenizers` and the text read by `datasets`, on Python's own standard-library source (nothing is downloaded).

Needs the extra `cmemi[hf]` (transformers, tokenizers, datasets); without it, importing this module fails with
one line naming `pip install 'cmemi[hf]'` (a config that names it exits 2).

Corpus: the source files of `charlm.CORPUS_MODULES` (argparse, dataclasses, difflib, ...) under
`sysconfig.get_paths()["stdlib"]`, in that order: the same text as the character-level example, so the same
on every machine with the same Python version (and the aggregator's dataset fingerprint refuses a worker whose
Python differs). `datasets` reads them as local text files, one document per file, into a cache in a temporary
directory that is removed once the text is in memory (`~/.cache/huggingface` is never written).

Tokenizer: byte-level BPE (`tokenizers`) trained on the first 90% of the text with a fixed vocabulary size;
the training is deterministic (same merges in every process: tests/test_hf_lm.py checks two processes with
different hash seeds), so every worker builds the same tokenizer and the same token ids without shipping a
file. The last 10% of the text is held out. Samples: non-overlapping windows of `block` token ids, x = ids[i :
i+block], y = ids[i+1 : i+block+1], int64.

Model: `transformers.GPT2LMHeadModel` from a `GPT2Config` (random initialisation under the run's seed, no
pretrained weights), its LM head tied to the token embedding as GPT-2's is. The factory returns the
`transformers` model itself: its forward returns a `CausalLMOutput`, and `loss` reads its `.logits`.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
import tempfile
from typing import Any

import torch
from cmemi.examples.charlm import CORPUS_MODULES
from cmemi.shared.config.extras import require
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

# Nothing of this example comes from a hub: set before `datasets` and `transformers` are imported, which read it
# once (a user who set it either way keeps theirs).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
datasets: Any = require("datasets", "hf", "the example cmemi.examples.hf_lm")
tokenizers: Any = require("tokenizers", "hf", "the example cmemi.examples.hf_lm")
transformers: Any = require("transformers", "hf", "the example cmemi.examples.hf_lm")
datasets.disable_progress_bars()  # reading 19 local files: no bar in every worker's log

VOCAB = 512
HELD_OUT = 0.1
EVAL_WINDOWS = 128
SEPARATOR = "\n"


def corpus_files() -> list[str]:
    """The stdlib source files of CORPUS_MODULES, in that order (a module file or a package's __init__.py)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = []
    for name in CORPUS_MODULES:
        base = os.path.join(stdlib, *name.split("."))
        found = [p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(p)]
        if not found:
            raise FileNotFoundError(f"the source of stdlib module {name!r} is not at {base}.py or {base}/__init__.py; "
                                    "cmemi.examples.hf_lm needs a Python installation that ships its .py sources")
        files.append(found[0])
    return files


@functools.lru_cache(maxsize=1)
def corpus() -> str:
    """The corpus text, read through `datasets` (one document per file, in corpus_files' order)."""
    files = corpus_files()
    with tempfile.TemporaryDirectory(prefix="cmemi-hf-datasets-") as cache:
        ds = datasets.load_dataset("text", data_files={"train": files}, sample_by="document", cache_dir=cache,
                                   keep_in_memory=True, split="train")
        docs = list(ds["text"])
    if len(docs) != len(files):
        raise RuntimeError(f"datasets read {len(docs)} documents from {len(files)} files; expected one per file")
    return SEPARATOR.join(docs)


def split_text(split: str) -> str:
    """The first 1 - HELD_OUT of the corpus' characters ('train') or the rest ('val')."""
    text = corpus()
    cut = int(len(text) * (1.0 - HELD_OUT))
    return text[:cut] if split == "train" else text[cut:]


@functools.lru_cache(maxsize=2)
def tokenizer(vocab: int = VOCAB) -> Any:
    """A byte-level BPE tokenizer of `vocab` ids trained on the train split (deterministic: see the docstring)."""
    tk = tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(split_text("train").split(SEPARATOR), trainer=trainer)
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} ids, not vocab={vocab}; pick a smaller vocab")
    return tok


@functools.lru_cache(maxsize=4)
def token_ids(split: str, vocab: int = VOCAB) -> torch.Tensor:
    """The token ids of `split` (int64), the text encoded as one sequence."""
    return torch.tensor(tokenizer(vocab).encode(split_text(split)).ids, dtype=torch.int64)


def make_dataset(split: str = "train", block: int = 64, vocab: int = VOCAB,
                 max_windows: int | None = None) -> TensorDataset:
    """TensorDataset(x, y) of int64 token windows, x:(N, block), y = x shifted left by one token.

    split: 'train' (first 90% of the text) or 'val' (last 10%). vocab: the tokenizer's size, equal to the
    model's `vocab`. max_windows: keep only the first this many windows.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    ids = token_ids(split, vocab)
    if len(ids) < block + 1:
        raise ValueError(f"the {split} split has {len(ids)} tokens, fewer than block + 1 = {block + 1}")
    w = ids.unfold(0, block + 1, block)
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    if max_windows is not None:
        x, y = x[:max_windows], y[:max_windows]
    return TensorDataset(x, y)


def make_model(vocab: int = VOCAB, block: int = 64, d_model: int = 64, n_layer: int = 2, n_head: int = 4,
               dropout: float = 0.0) -> nn.Module:
    """A GPT-2 causal LM from its config, randomly initialised (the run seeds torch before calling this)."""
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=block, n_embd=d_model, n_layer=n_layer,
                                     n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     use_cache=False, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all B*T positions of the model output's `.logits` (a tensor works too)."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@functools.lru_cache(maxsize=4)
def eval_batch(block: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed, evenly spaced subset of EVAL_WINDOWS held-out windows."""
    x, y = make_dataset("val", block=block, vocab=vocab).tensors
    picks = torch.linspace(0, len(x) - 1, min(EVAL_WINDOWS, len(x))).round().to(torch.int64).unique()
    return x[picks], y[picks]


def evaluate(model: nn.Module) -> dict[str, float]:
    """Held-out loss (nats per token) and perplexity on a fixed subset of the 'val' split."""
    config = getattr(model, "config", None)
    x, y = eval_batch(int(getattr(config, "n_positions", 64)), int(getattr(config, "vocab_size", VOCAB)))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            value = loss(model(x), y).item()
    finally:
        model.train(was_training)
    return {"loss": value, "perplexity": math.exp(value)}
