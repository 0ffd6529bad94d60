"""`cmemi reference`'s summary, computed once per config per test session.

Many integration tests compare a cluster with the single-process reference of the same config, and several compute
the same one: the six whole-round outer-codec tests each recompute the plain local-steps reference (and the int4 and
sparse2 uplink-only ones twice, once as `compression.downlink=none` and once without it) — 6.5 s a reference on this
machine's loaded cores (`time python -m cmemi reference examples/digits.yaml --set train.local_steps=5 ...`). The
reference is a pure function of its config (the product's promise: the same config gives the same bits), so one
computation per config serves the session.

The key is the config's canonical bytes: the loaded config (YAML, `CMEMI__` environment overrides, `--set`s) as
sorted JSON, without `run.name` and `run.dir` (they name Redis keys and the output directory, never the result), so
two spellings of one config (a default set explicitly, sets in another order) share one run. What the config names
by path (a weights file, a dataset on disk) is not in the key: a test that rewrites such a file between two
references must call `compute` itself."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

from cmemi.shared.config.loading import load_config, to_dict

from tests.conftest import DIGITS, ROOT, cmemi_cmd

SUMMARIES: dict[str, dict[str, Any]] = {}


def key(config: str, sets: tuple[str, ...]) -> str:
    """The config's canonical bytes, hashed: what decides the reference's result."""
    loaded = to_dict(load_config(config, list(sets)))
    loaded["run"].pop("name")
    loaded["run"].pop("dir")
    return hashlib.sha256(json.dumps(loaded, sort_keys=True, default=repr).encode()).hexdigest()


def compute(out_dir: Path, *sets: str, config: str = DIGITS, timeout: float = 300) -> dict[str, Any]:
    """Run `cmemi reference` now (no cache) and return its summary; AssertionError with its stderr if it fails."""
    out = out_dir / f"reference-{key(config, sets)[:12]}.json"
    proc = subprocess.run(cmemi_cmd("reference", config, *[a for s in sets for a in ("--set", s)], "--out", str(out)),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def reference(out_dir: Path, *sets: str, config: str = DIGITS, timeout: float = 300) -> dict[str, Any]:
    """`cmemi reference`'s summary of `config` with `sets`: computed the first time this session asks for that config
    (its file in `out_dir`), a copy of the first result after that."""
    k = key(config, sets)
    if k not in SUMMARIES:
        SUMMARIES[k] = compute(out_dir, *sets, config=config, timeout=timeout)
    return copy.deepcopy(SUMMARIES[k])
