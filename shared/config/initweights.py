"""`model.init_from`: start a run from pretrained weights or another run's, checked name by name.

Where the weights come from: a .safetensors file (a run's `model.safetensors`, `cmemi checkpoints export`), a
.pt/.pth state_dict (`torch.load(weights_only=True)`), a checkpoint directory (its model.safetensors), a run
directory (its final model.safetensors, else its newest checkpoint's) or a Hugging Face `save_pretrained`
directory (model.safetensors, or shards with model.safetensors.index.json: pretrained.py). Names and shapes are
checked against the model's state_dict (parameters and persistent buffers), one line per mismatch: missing (the
model has it, the file does not: a name tied to one the file has, as GPT-2's `lm_head.weight`, is not missing),
unexpected (the file has it, the model does not), wrong shape. Under `model.init_strict: false`
what matches is loaded and the rest keeps the factory's values (a new head for another class count).

Only the parameter servers load it (services/aggregator/common/trainer/): the initial weights are one canonical
copy, sent to the workers with the first parameters, and `cmemi reference` loads it the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cmemi.shared.config import pretrained
from cmemi.shared.config.checks import ConfigError

if TYPE_CHECKING:
    import torch

FIELD = "config field 'model.init_from'"
SHOWN = 20  # mismatch lines listed before "... and N more"


class InitError(ConfigError):
    """model.init_from cannot be used: the file is missing or unreadable, or (strict) does not fit the model."""


def weights_file(path: str) -> Path:
    """The weights file `path` names (a file, a checkpoint directory or a run directory)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if (p / "model.safetensors").is_file():
            return p / "model.safetensors"
        index = pretrained.index_file(p)
        if index is not None:  # a sharded save_pretrained directory
            return index
        steps = sorted(d for d in (p / "checkpoints").glob("step-*") if (d / "model.safetensors").is_file())
        if steps:
            return steps[-1] / "model.safetensors"
        raise InitError(f"{FIELD} = {path!r}: the directory holds no model.safetensors and no checkpoint (nor a "
                        f"{pretrained.INDEX}); give a run directory that completed or checkpointed, a save_pretrained "
                        "directory, or a .safetensors file")
    raise InitError(f"{FIELD} = {path!r}: no such file or directory (relative paths start at {Path.cwd()}); "
                    "give a .safetensors or .pt file, a checkpoint directory or a run directory")


def read(path: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """The state_dict stored at `path` (see weights_file), on the CPU."""
    import torch  # here: `cmemi up` checks that the file exists (weights_file) before it imports torch

    f = weights_file(path)
    try:
        if f.suffix in (".pt", ".pth", ".bin"):
            sd = torch.load(f, map_location="cpu", weights_only=True)
            sd = sd.get("state_dict", sd) if isinstance(sd, dict) else sd
        elif f.name == pretrained.INDEX:
            sd = pretrained.read_sharded(f)
        else:
            from safetensors.torch import load_file

            sd = load_file(str(f))
    except Exception as exc:  # any reader's error: the file is not weights
        raise InitError(f"{FIELD} = {path!r}: cannot read {f} as a state_dict ({type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:200]}); give a .safetensors file or a .pt state_dict") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise InitError(f"{FIELD} = {path!r}: {f} holds a {type(sd).__name__}, not a state_dict of tensors; save "
                        "model.state_dict()")
    return f, sd


def mismatches(expected: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor],
               tied: dict[str, list[str]] | None = None) -> list[str]:
    """One line per name that does not fit: missing (and no name `tied` to it is in the file), unexpected, wrong
    shape."""
    tied = tied or {}
    lines = [f"missing: {n} {list(t.shape)} (in the model, not in the file)" for n, t in expected.items()
             if pretrained.covered(n, tied, loaded) is None]
    lines += [f"unexpected: {n} {list(t.shape)} (in the file, not in the model)" for n, t in loaded.items()
              if n not in expected]
    lines += [f"wrong shape: {n} is {list(loaded[n].shape)} in the file, {list(t.shape)} in the model"
              for n, t in expected.items() if n in loaded and loaded[n].shape != t.shape]
    return lines


def load_into(model: torch.nn.Module, path: str, strict: bool) -> list[str]:
    """Copy the weights at `path` into `model` (in place); returns the mismatch lines skipped (strict: none, or
    InitError listing them)."""
    import torch

    f, loaded = read(path)
    expected = model.state_dict()
    tied = pretrained.tied_names(expected)
    lines = mismatches(expected, loaded, tied)
    if lines and strict:
        shown = "\n  ".join(lines[:SHOWN]) + (f"\n  ... and {len(lines) - SHOWN} more" if len(lines) > SHOWN else "")
        raise InitError(f"{FIELD} = {path!r}: {len(lines)} names or shapes of {f} differ from the model's "
                        f"(set model.init_strict: false to load what matches):\n  {shown}")
    with torch.no_grad():
        for n, t in expected.items():
            src = pretrained.covered(n, tied, loaded)
            if src is not None and loaded[src].shape == t.shape:
                t.copy_(loaded[src])
    return lines


def say_skipped(path: str, lines: list[str]) -> None:
    """Under init_strict: false, what kept the factory's values: said once, on stderr, at start-up."""
    if lines:
        print(f"cmemi: model.init_from {path!r}: kept the factory's values for {len(lines)} names (init_strict: "
              "false):\n  " + "\n  ".join(lines[:SHOWN]), file=sys.stderr, flush=True)
