"""When the leader evaluates and what early stopping decides (services/aggregator/leader/eval_schedule.py), with a
real background evaluation of the digits model: the evaluation started at one boundary decides at the next, so the
same evaluations stop the run at the same step whatever ran faster; sharded, an evaluation waits for every shard's
pieces, and a snapshot taken meanwhile names it to run again after a restore."""

from __future__ import annotations

from pathlib import Path

import pytest
from cmemi.services.aggregator.leader.eval_schedule import EvalSchedule
from cmemi.shared.config.plugins import build_model, resolve

from tests.helpers.rig import context

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def schedule(tmp_path: Path, redis_server):
    ctx = context(tmp_path, redis_server.url, "eval.fn=tests.helpers.fixtures:constant_eval", "eval.every_steps=2",
                  "eval.early_stop_metric=score", "eval.patience=1", name="evals")
    reported: list[dict] = []
    evals = EvalSchedule(ctx, ctx.cfg, resolve(ctx.cfg.eval.fn, "eval.fn"), reported.append)
    weights = build_model(ctx.cfg).state_dict()
    try:
        yield evals, reported, lambda: {k: v.clone() for k, v in weights.items()}
    finally:
        evals.close()


def test_the_evaluation_of_one_boundary_decides_early_stopping_at_the_next(schedule) -> None:
    evals, reported, weights = schedule
    assert not evals.stops_at(1) and not evals.stops_at(3)  # not boundaries: nothing collected
    evals.after_step(2, weights, False, lambda _s, _w: True)
    assert not evals.stops_at(4)  # step 2's score is the best so far
    assert [e["step"] for e in reported] == [2]
    evals.after_step(4, weights, False, lambda _s, _w: True)
    assert evals.stops_at(6) and evals.stopped  # step 4's is no better: patience 1 is used up
    assert [e["step"] for e in reported] == [2, 4] and evals.history == reported


def test_a_sharded_evaluation_waits_for_every_shards_pieces_and_a_snapshot_names_it(schedule) -> None:
    evals, reported, weights = schedule
    placed: list[int] = []
    evals.after_step(2, weights, True, lambda step, _w: False)  # the other shards' pieces are not in yet
    assert evals.settle(2) == 2  # a snapshot of step 2 names the evaluation to run after a restore
    evals.pieces_in(lambda step, _w: placed.append(step) is None)
    assert placed == [2] and evals.settle(2) is None  # started now
    evals.finish()
    assert [e["step"] for e in reported] == [2]
