"""Which class each `metrics.loggers` name is, and the check that its package is installed — made by `cmemi up`
before any service starts (and by the leader, for a service started on its own), so a missing one is one line
naming the field and the pip extra, exit 2, not a failure mid-run."""

from __future__ import annotations

import importlib.util

from cmemi.services.aggregator.leader.trackers.base import Tracker
from cmemi.shared.config.extras import MissingExtra
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.schema import Config

# name -> (the class, the Python package it needs; the pip extra has the tracker's name)
BUILTIN = {
    "tensorboard": ("cmemi.services.aggregator.leader.trackers.tensorboard:TensorBoard", "tensorboard"),
    "mlflow": ("cmemi.services.aggregator.leader.trackers.mlflow:MLflow", "mlflow"),
    "wandb": ("cmemi.services.aggregator.leader.trackers.wandb:WandB", "wandb"),
}


def check(cfg: Config) -> None:
    """Every tracker named can be made: a built-in one's package is installed (found, not imported: importing
    mlflow takes seconds), an import path resolves to a Tracker class."""
    for name in cfg.metrics.loggers:
        if name in BUILTIN:
            if importlib.util.find_spec(BUILTIN[name][1]) is None:
                raise MissingExtra(f"config field 'metrics.loggers' names {name!r}, which needs the Python package "
                                   f"{BUILTIN[name][1]!r}: pip install 'cmemi[{name}]'")
        else:
            tracker_class(name)


def tracker_class(name: str) -> type[Tracker]:
    cls = resolve(BUILTIN[name][0] if name in BUILTIN else name, "metrics.loggers")
    if not (isinstance(cls, type) and issubclass(cls, Tracker)):
        from cmemi.shared.config.checks import fail

        fail("metrics.loggers", name, "is not a Tracker class",
             "subclass cmemi.services.aggregator.leader.trackers.base.Tracker")
    return cls


def make(name: str) -> Tracker:
    tracker = tracker_class(name)()
    tracker.name = name
    return tracker
