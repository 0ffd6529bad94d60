"""Periodic evaluation in the background, on a copy of the weights, so the step loop does not stall.

Early stopping stays deterministic: the decision from the evaluation at step s is taken at the next
evaluation boundary (s + every_steps), waiting for that evaluation only if it is still running then.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from cmemi.shared.config import Config
from cmemi.shared.plugins import build_model


class BackgroundEval:
    def __init__(self, cfg: Config, fn: Any) -> None:
        self.cfg, self.fn = cfg, fn
        self.model = build_model(cfg)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval")
        self.running: tuple[int, Future] | None = None
        self.history: list[dict[str, Any]] = []
        self.best: float | None = None
        self.since_best = 0

    def _run(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        self.model.load_state_dict(state)
        self.model.eval()
        with torch.no_grad():
            return {k: float(v) for k, v in dict(self.fn(self.model)).items()}

    def start(self, step: int, state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        """Evaluate `state` (a copy) in the background; first collects the previous evaluation, waiting if needed."""
        done = self.collect(wait=True)
        self.running = (step, self.pool.submit(self._run, state))
        return done

    def collect(self, wait: bool = False) -> list[dict[str, Any]]:
        if self.running is None or (not wait and not self.running[1].done()):
            return []
        step, future = self.running
        self.running = None
        entry = {"step": step, "eval": future.result()}
        self.history.append(entry)
        self._track(entry["eval"])
        return [entry]

    def _track(self, result: dict[str, float]) -> None:
        name = self.cfg.eval.early_stop_metric
        if name is None:
            return
        if name not in result:
            raise KeyError(f"eval.early_stop_metric={name!r} is not among the metrics evaluate() returns: "
                           f"{sorted(result)}")
        value = result[name] if self.cfg.eval.early_stop_mode == "max" else -result[name]
        if self.best is None or value > self.best:
            self.best, self.since_best = value, 0
        else:
            self.since_best += 1

    @property
    def should_stop(self) -> bool:
        return self.cfg.eval.early_stop_metric is not None and self.since_best >= self.cfg.eval.patience

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
