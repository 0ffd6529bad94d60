"""MLflow: one run in experiment `cmemi` ($MLFLOW_EXPERIMENT_NAME), on $MLFLOW_TRACKING_URI if set, else in the
run directory's own store: `sqlite:///RUN_DIR/mlruns/mlflow.db` with artifacts in RUN_DIR/mlruns/artifacts. A
SQLite database is what MLflow 3 recommends for a local store (its default tracking URI is `sqlite:///mlflow.db`;
the `./mlruns` file store is deprecated). Steps and evaluations are metrics, the config is the run's params, each
event a JSON artifact `events/NNNNN_<kind>.json` and a metric `events/<kind>` counting them."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from cmemi.services.aggregator.leader.trackers.base import Tracker, keep_state, read_state
from cmemi.shared.config.schema import Config

PARAMS_PER_BATCH = 100  # MLflow's limit on params per log_batch call
PARAM_CHARS = 6000  # and on a param value's length
METRICS_PER_BATCH = 1000  # and on metrics per log_batch call


class MLflow(Tracker):
    name = "mlflow"

    def location(self, run_dir: Path) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlruns' / 'mlflow.db'}"

    def open(self, run_dir: Path, cfg: Config, params: dict[str, Any]) -> str:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        uri = self.location(run_dir)
        own_store = "MLFLOW_TRACKING_URI" not in os.environ
        if own_store:
            (run_dir / "mlruns").mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "cmemi")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(
            name, artifact_location=(run_dir / "mlruns" / "artifacts").as_uri() if own_store else None)
        resumed = self.resumable(read_state(run_dir, self.name).get("run_id"))
        if resumed:  # a restarted leader: the same MLflow run goes on (its params are logged already)
            self.run_id = resumed
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=cfg.run.name).info.run_id
            keep_state(run_dir, self.name, {"run_id": self.run_id})
            items = [Param(k, str(v)[:PARAM_CHARS]) for k, v in params.items()]
            for i in range(0, len(items), PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=items[i:i + PARAMS_PER_BATCH])
        self.events = len(self.client.list_artifacts(self.run_id, "events")) if resumed else 0
        self.pending: list[Metric] = []
        return uri

    def resumable(self, run_id: object) -> str | None:
        """The run a previous leader of this run directory opened, if its store still holds it, not deleted."""
        from mlflow.exceptions import MlflowException

        if not isinstance(run_id, str):
            return None
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None
        return run_id if run.info.lifecycle_stage == "active" else None

    def scalars(self, step: int, values: dict[str, float], t: float) -> None:
        from mlflow.entities import Metric

        ms = int(t * 1000)
        self.pending.extend(Metric(k, v, ms, step) for k, v in values.items())

    def flush(self) -> None:
        """The metrics kept since the last flush in log_batch calls of up to 1000 (MLflow's limit): on the SQLite
        store each call is a transaction, and one per step could not keep up with a fast run."""
        for i in range(0, len(self.pending), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=self.pending[i:i + METRICS_PER_BATCH])
        self.pending.clear()

    def event(self, step: int, kind: str, text: str, count: int) -> None:
        self.events += 1
        self.client.log_text(self.run_id, text, f"events/{self.events:05d}_{kind}.json")
        self.client.log_metric(self.run_id, f"events/{kind}", count, int(time.time() * 1000), step)

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id)
