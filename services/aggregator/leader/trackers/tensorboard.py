"""TensorBoard: event files under RUN_DIR/tensorboard/, written with torch's own SummaryWriter (the
`tensorboard` package, `pip install 'cmemi[tensorboard]'`). Steps and evaluations are scalars, the config is
TensorBoard's hyperparameter table (its HPARAMS tab) and a `config` text, events are text (`events`) and a count
per kind (`events/<kind>`), read back with `tensorboard.backend.event_processing.EventAccumulator`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cmemi.services.aggregator.leader.trackers.base import Tracker
from cmemi.shared.config.schema import Config


class TensorBoard(Tracker):
    name = "tensorboard"

    def location(self, run_dir: Path) -> str:
        return str(run_dir / "tensorboard")

    def open(self, run_dir: Path, cfg: Config, params: dict[str, Any]) -> str:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        where = self.location(run_dir)
        self.writer = SummaryWriter(log_dir=where)
        experiment, start, end = hparams(params, {"loss": 0.0})  # the table's columns: every field, and the loss
        file_writer = self.writer.file_writer
        assert file_writer is not None  # SummaryWriter makes it in its __init__
        for summary in (experiment, start, end):
            file_writer.add_summary(summary)
        self.writer.add_text("config", "\n".join(f"    {k}: {json.dumps(v)}" for k, v in params.items()), 0)
        return where

    def scalars(self, step: int, values: dict[str, float], t: float) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step, walltime=t)

    def event(self, step: int, kind: str, text: str, count: int) -> None:
        self.writer.add_text("events", text, step)
        self.writer.add_scalar(f"events/{kind}", count, step)

    def flush(self) -> None:
        """To disk now, not at SummaryWriter's 120 s flush: the process dies with its leader (child.py), and what
        it held back would die with it."""
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
