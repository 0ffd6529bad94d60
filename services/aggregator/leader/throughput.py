"""samples/s, one definition everywhere: samples trained ÷ training wall-clock seconds over an interval.

metrics.jsonl: the interval is the step (global_batch / step_time_s); the progress line and `cmemi status`:
about the last second of training, and the whole run once the last step is done; summary.json: the whole run (steps × global_batch / wall_s).
"""

from __future__ import annotations


class Throughput:
    """samples/s over about the last `window` seconds of training wall time."""

    def __init__(self, global_batch: int, window: float = 1.0) -> None:
        self.global_batch = global_batch
        self.window = window
        self.mark: tuple[int, float] | None = None  # (step, training wall seconds) at the window's start

    def rate(self, step: int, wall: float, whole_run: bool = False) -> float:
        """Since the window's start; with whole_run (the last step: what summary.json says) since the run's."""
        mark = self.mark if self.mark is not None and not whole_run else (0, 0.0)  # earlier terms included
        if self.mark is None or wall - mark[1] >= self.window:
            self.mark = (step, wall)
        dt = wall - mark[1]
        return (step - mark[0]) * self.global_batch / dt if dt > 0 else 0.0
