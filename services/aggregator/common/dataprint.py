"""The run's dataset fingerprint, held by the aggregator without reading the dataset.

Workers read the data; the aggregator only checks that they all read the same (shared/core/data.py fingerprint). It
used to build the whole dataset to fingerprint it itself, on the path to the first step and competing with the
workers for the CPU. Now the run's fingerprint is the checkpoint's when it restores one, else the first admitted
worker's: every later worker (a replacement, another host) must match it, and every checkpoint records it, so a
dataset that changes between a checkpoint and a restart is still refused, at the first worker's hello.
"""

from __future__ import annotations

from typing import Any


def agrees(run: dict[str, Any], worker: dict[str, Any]) -> bool:
    """Does a worker's fingerprint match the run's (`run`, filled in place by the first one to arrive)?"""
    if not run:
        run.update(worker)
    return worker == run


def adopt(run: dict[str, Any], checkpoint: dict[str, Any] | None) -> bool:
    """At restore: the checkpoint's fingerprint becomes the run's (an older checkpoint written before any worker
    was admitted holds none). False when the run already holds another."""
    if not checkpoint:
        return True
    return agrees(run, checkpoint)
