"""Periodic evaluation in the background, on a copy of the weights, so the step loop does not stall.

Early stopping stays deterministic: the decision from the evaluation at step s is taken at the next
evaluation boundary (s + every_steps), waiting for that evaluation only if it is still running then.
Its state (history, best, evaluations since the best, the evaluation in flight) is in every snapshot.

`probe` runs the user's evaluation once at step 0, in the background, so a broken eval.fn stops the run
in seconds instead of after training.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from cmemi.shared.config.plugins import build_model
from cmemi.shared.config.schema import Config
from cmemi.shared.config.usercode import describe
from cmemi.shared.errors import FaultError


def eval_boundary(cfg: Config, step: int) -> bool:
    """Is `step` one where the whole model is evaluated during training (eval.every_steps; not the last step,
    whose evaluation is the final one)?"""
    return bool(cfg.eval.fn and cfg.eval.every_steps) and step % cfg.eval.every_steps == 0 and step < cfg.train.rounds


class EvalError(FaultError, RuntimeError):
    """The user's eval.fn raised or returned something that is not a dict of numbers: one line, with where."""


def run_eval(fn: Any, model: torch.nn.Module, name: str) -> dict[str, float]:
    model.eval()
    try:
        with torch.no_grad():
            result = fn(model)
        return {k: float(v) for k, v in dict(result).items()}
    except Exception as exc:
        raise EvalError(f"eval.fn {name} failed: {describe(exc).line()}; fix it and run again") from None
    finally:
        model.train()


class Probe:
    """The first evaluation, at step 0, in a background thread: only its failure matters."""

    def __init__(self, cfg: Config, fn: Any, state: dict[str, torch.Tensor]) -> None:
        self.error: str | None = None
        self.done = threading.Event()
        model = build_model(cfg)
        model.load_state_dict(state)
        threading.Thread(target=self._run, args=(fn, model, cfg.eval.fn), daemon=True, name="eval-probe").start()

    def _run(self, fn: Any, model: torch.nn.Module, name: str) -> None:
        try:
            run_eval(fn, model, name)
        except EvalError as exc:
            self.error = str(exc)
        finally:
            self.done.set()


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
        return run_eval(self.fn, self.model, str(self.cfg.eval.fn))

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

    def running_step(self) -> int | None:
        return self.running[0] if self.running is not None else None

    def state_dict(self) -> dict[str, Any]:
        """What decides early stopping, for the snapshot (the evaluation in flight is named by its step)."""
        return {"history": self.history, "best": self.best, "since_best": self.since_best,
                "running": self.running_step()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.history = list(sd["history"])
        self.best = None if sd["best"] is None else float(sd["best"])
        self.since_best = int(sd["since_best"])

    @property
    def should_stop(self) -> bool:
        return self.cfg.eval.early_stop_metric is not None and self.since_best >= self.cfg.eval.patience

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
