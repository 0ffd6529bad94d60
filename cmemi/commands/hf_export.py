"""`cmemi checkpoints export RUN_DIR --format hf -o DIR`: a run's weights as a Hugging Face `save_pretrained`
directory, which `AutoModelForCausalLM.from_pretrained(DIR)` (or the model class's) opens.

Why through the run's own factory: the Hugging Face config (config.json: architecture, sizes, tied embeddings)
is not in a CMEMI run's files, only the factory and its kwargs are (RUN_DIR/config.yaml). So the model is built
as the run built it, the weights loaded into it by model.init_from's loader (names and shapes checked; a tied
name the file holds once is filled through its twin), and `transformers` writes the directory itself: its
config.json, safetensors, tied weights written once, as any `save_pretrained`. The weights: the run's final
model.safetensors, else its newest checkpoint that verifies; `--step N` picks a checkpoint.

A run whose model is not a `transformers.PreTrainedModel` has no config.json to write: one line, exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cmemi.services.checkpointer.store import CheckpointStore
from cmemi.shared.errors import UserError
from cmemi.shared.runtime.exits import Exit


class ExportError(UserError, RuntimeError):
    """The run cannot be exported in Hugging Face form: the one-line reason and the fix."""


def weights(run_dir: Path, step: int | None) -> Path:
    """The weights file to export: checkpoint `step` (verified), else the final model.safetensors, else the newest
    checkpoint that verifies."""
    store = CheckpointStore(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else None
    if step is not None:
        infos = store.list() if store else []
        info = next((i for i in infos if i.step == step), None)
        if info is None or store is None:
            raise ExportError(f"no checkpoint of step {step} in {run_dir}; have: {[i.step for i in infos]}")
        problem = store.verify(info.path)
        if problem:
            raise ExportError(f"checkpoint of step {step} is damaged: {problem}")
        return info.path / "model.safetensors"
    if (run_dir / "model.safetensors").is_file():
        return run_dir / "model.safetensors"
    good = store.latest_good() if store else None
    if good is None:
        raise ExportError(f"{run_dir} holds no model.safetensors and no checkpoint that verifies; pass the run "
                          "directory of a cmemi run that completed or checkpointed")
    return good.path / "model.safetensors"


def build(run_dir: Path) -> Any:
    """The run's model as its factory builds it from RUN_DIR/config.yaml; ExportError when not a transformers model."""
    from cmemi.shared.config.extras import require
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.config.plugins import build_model

    transformers = require("transformers", "hf", "cmemi checkpoints export --format hf")
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ExportError(f"{saved} not found: the run's config says which model to build; pass the run directory "
                          "of a cmemi run")
    cfg = load_config(saved)
    model = build_model(cfg)
    if not isinstance(model, transformers.PreTrainedModel):
        raise ExportError(f"--format hf needs a transformers PreTrainedModel, and the run's model.factory "
                          f"{cfg.model.factory} returns a {type(model).__name__}; export its weights with "
                          "--format safetensors (or pt) instead")
    return model


def export(run_dir: Path, out: Path, step: int | None) -> Path:
    """Write the run's weights to `out` as a save_pretrained directory; returns the weights file exported."""
    from cmemi.shared.config import initweights

    model = build(run_dir)  # first: a run that cannot be exported in this form is told so whatever its weights
    source = weights(run_dir, step)
    initweights.load_into(model, str(source), strict=True)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one line says what was written
    model.save_pretrained(out)
    return source


def main(run_dir: str, output: str | None, step: int | None) -> int:
    """The command: one line on success, one `cmemi: error:` line and exit 2 on a user error."""
    out = Path(output) if output else Path(run_dir) / "export-hf"
    try:
        source = export(Path(run_dir), out, step)
    except UserError as exc:  # ConfigError, MissingExtra, FactoryError, ExportError
        print(f"cmemi: error: {exc}", file=sys.stderr)
        return Exit.FATAL
    print(f"exported {source} as a Hugging Face model directory to {out} "
          "(transformers: AutoModelForCausalLM.from_pretrained)")
    return 0
