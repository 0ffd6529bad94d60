"""Weights & Biases: a run in project `cmemi` ($WANDB_PROJECT) under RUN_DIR/wandb/, offline unless the user has
logged in ($WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc) or set $WANDB_MODE. Offline, nothing leaves the
machine: `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later. Steps and evaluations are history rows, the
config is the run's config, each event in a row's `event` text (one line each) and count (`events/<kind>`); evaluations are
plotted against `eval/step`."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any, Literal, cast

from cmemi.services.aggregator.leader.trackers.base import Tracker, keep_state, read_state
from cmemi.shared.config.schema import Config

Mode = Literal["online", "offline", "disabled", "shared"]


def mode() -> Mode:
    """$WANDB_MODE if set; online if the user has logged in; offline otherwise (a run never asks for a login)."""
    if os.environ.get("WANDB_MODE"):
        return cast("Mode", os.environ["WANDB_MODE"])  # wandb itself says what it accepts
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


class WandB(Tracker):
    name = "wandb"

    def location(self, run_dir: Path) -> str:
        return str(run_dir / "wandb")

    def open(self, run_dir: Path, cfg: Config, params: dict[str, Any]) -> str:
        import wandb

        # console capture and system stats off: the leader's output is its own, and stats would sample the CPU
        settings = wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False,
                                  silent=True)
        saved = read_state(run_dir, self.name).get("run_id")  # a restarted leader: the same W&B run goes on
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "cmemi"), name=cfg.run.name,
                              dir=str(run_dir), mode=mode(), config=params, settings=settings, reinit="create_new",
                              id=saved if isinstance(saved, str) else None, resume="allow")
        keep_state(run_dir, self.name, {"run_id": self.run.id})
        self.run.define_metric("eval/*", step_metric="eval/step")
        self.last = 0  # the newest step logged
        self.eval_row = -1  # the newest row an evaluation went in
        self.event_row: tuple[int, list[str]] = (-1, [])  # the newest row events went in, and their texts
        return str(Path(self.run.dir).parent)  # RUN_DIR/wandb/<offline-run-...>

    def scalars(self, step: int, values: dict[str, float], t: float) -> None:
        if any(k.startswith("eval/") for k in values):
            # an evaluation is collected while later steps train (services/aggregator/leader/eval_schedule.py), and
            # W&B's steps only go forward: it goes in the newest row, plotted against its own `eval/step`; a row
            # takes one evaluation (the final one comes in the same row as the one before it otherwise)
            at = max(step, self.last)
            self.eval_row = at + 1 if at == self.eval_row else at
            self.log({**values, "eval/step": step}, self.eval_row)
        else:
            self.log(values, step)

    def event(self, step: int, kind: str, text: str, count: int) -> None:
        # a row holds one value per key: the events of one row go in its `event` as lines, the newest last
        if max(step, self.last) != self.event_row[0]:
            self.event_row = (max(step, self.last), [])
        self.event_row[1].append(text)
        self.log({"event": "\n".join(self.event_row[1]), f"events/{kind}": count}, step)

    def log(self, values: dict[str, Any], step: int) -> None:
        self.last = max(self.last, step)
        self.run.log(values, step=self.last)

    def close(self) -> None:
        self.run.finish()
