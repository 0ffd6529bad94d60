"""The end of a run on the leader: the whole model's result, the final checkpoint, then the final evaluation.

Sharded, the final checkpoint is written first and the optimizer's state dropped; then every shard's pieces after
the last step are gathered: the result's hash is taken over them piece by piece, and the whole model is built only
for a final evaluation (docs/design.md §8). The final checkpoint is written before the final evaluation, so a crash there loses
nothing. `summary.json` holds the result (`params_sha256`: the same bits for any worker count, shard count and
faults); the run's state becomes `completed` in Redis, and workers that ask in the next moment are told to stop.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import redis
import zmq
from cmemi.services.aggregator.common.evaluation import EvalError, run_eval
from cmemi.services.aggregator.leader.parts import LeaderParts
from cmemi.services.aggregator.leader.stepping import Stepper
from cmemi.services.aggregator.snapshots.send import CheckpointerLink
from cmemi.shared.coordination.membership import table
from cmemi.shared.runtime import atomic
from cmemi.shared.runtime.service import ServiceContext


def finish(parts: LeaderParts, stepper: Stepper, pump: Callable[[], None]) -> dict[str, Any]:
    """Write the run's result (summary.json, the final checkpoint) and mark it completed; returns the summary.
    `pump`: receives one message (the shards' final pieces come while the leader waits for them)."""
    ctx, cfg, trainer, evals, roster = parts.ctx, parts.cfg, parts.trainer, parts.evals, parts.slices  # sharded
    reporter, ckpt, totals, term, drops = parts.reporter, parts.ckpt, parts.totals, parts.term, parts.drops.as_dict()
    wall = totals.wall_s()
    evals.finish()
    summary: dict[str, Any] = {
        "steps": trainer.step, "final_loss": totals.final_loss, "eval": {}, "wall_s": wall,
        "samples_per_s": trainer.step * cfg.train.samples_per_round / wall if wall > 0 else None,
        "workers": cfg.cluster.workers, "duplicate_param_sends": totals.duplicate_param_sends,
        **({"inner_states_sent": totals.inner_states_sent} if cfg.train.local_steps else {}),
        **({"inner_rounds_replayed": totals.inner_rounds_replayed} if cfg.train.state_every > 1 else {}),
        **({"segments_ahead": totals.segments_ahead} if cfg.train.fragments > 1 else {}), "final_lr": trainer.lr,
        **(parts.leasing.pace.summary() if cfg.train.local_steps else {}),  # who computed the replicas (pace.py)
        "dropped_messages": drops, "term": term, "codec": cfg.compression.codec,
        "precision": cfg.precision, "skipped_steps": trainer.skipped,
        "stopped_early": stepper.stopped_early, "eval_history": evals.history,
    }
    others = None
    if roster is not None:
        # sharded, the final checkpoint goes first (its summary is the leader's: the other shards' totals and the
        # result's hash come with their pieces), then the optimizer's state, and only then come the other shards'
        # pieces: a whole model beside the state would pass the leader's memory budget (docs/design.md §8)
        summary["final_checkpoint"] = _save_final(stepper, ckpt, summary)
        trainer.drop_optimizer_state()
        trainer.release_heap()
        others = roster.gather(trainer.whole_shapes, pump)
    shards_total = roster.total if roster is not None else (lambda _field: 0)
    summary.update({
        "bytes_sent": totals.bytes_in + shards_total("bytes_sent"),
        "bytes_received": totals.bytes_out + shards_total("bytes_received"),
        # of those, what moved through shared-memory slots (same-host workers, shared/memory/shm.py), not a socket
        "bytes_sent_via_slots": totals.slot_in + shards_total("bytes_sent_via_slots"),
        "bytes_received_via_slots": totals.slot_out + shards_total("bytes_received_via_slots"),
        "params_sha256": trainer.params_sha256(others),
        **({"mirror_sha256": trainer.mirror_sha256(roster.mirror_hashes() if roster is not None else None),
            "downlink": cfg.compression.downlink,
            # parameter messages by server: changes (or chains of them), and whole mirrors (docs/design.md §9)
            "changes_sent": totals.changes_sent + shards_total("changes_sent"),
            "mirrors_sent": totals.mirrors_sent + shards_total("mirrors_sent")} if trainer.mirror is not None else {}),
        # streaming: parameter messages of only the pieces changed since the worker's version (docs/design.md §10)
        **({"changes_sent": totals.changes_sent + shards_total("changes_sent")} if trainer.fragments else {}),
    })
    if cfg.train.local_steps:  # train.inner_states: shards, the shards' replicas' states sent too
        summary["inner_states_sent"] += shards_total("inner_states_sent")
        if "inner_rounds_replayed" in summary:  # train.state_every > 1: the shards' replicas' replays too
            summary["inner_rounds_replayed"] += shards_total("inner_rounds_replayed")
    if roster is not None:  # bytes_sent/received above are the whole cluster's; here, shard by shard
        summary["shards"] = [{"shard": 0, "bytes_sent": totals.bytes_in, "bytes_received": totals.bytes_out},
                             *roster.summary()]
    else:
        summary["final_checkpoint"] = _save_final(stepper, ckpt, summary)
    if evals.fn:
        if others is not None:  # the final evaluation runs on the whole model: built now, after the final checkpoint
            trainer.materialize(others)
        try:
            summary["eval"] = run_eval(evals.fn, trainer.model, str(cfg.eval.fn))
        except EvalError as exc:
            ctx.fatal(f"{exc} (the final checkpoint {summary['final_checkpoint']} was written)")
    if summary["eval"]:  # the final evaluation, which metrics.jsonl does not hold, goes to the trackers too
        reporter.trackers.line({"step": trainer.step, "eval": summary["eval"]})
    summary.update(reporter.close_trackers())  # after the final checkpoint: a hung tracker cannot lose it
    summary["checkpointer_dropped_messages"] = _checkpointer_drops(ctx)
    if stepper.stall_s:
        summary["checkpoint_stall_s_median"] = statistics.median(stepper.stall_s)
    if (log := parts.steplog) is not None and log.entries:  # the leader's entries shipped by this process: their
        # tensors' bytes a step, and how many went as the step's gradients as they came (steplog/frames.py)
        summary["step_log_bytes"] = log.entry_bytes // log.entries
        summary["step_log_encoded_entries"] = log.encoded_entries
    atomic.write_text(ctx.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    reporter.flush(timeout=10)  # the last step's progress before the run is complete
    _set_completed(ctx)
    ctx.emit("run_completed", steps=trainer.step, params_sha256=summary["params_sha256"])
    ctx.log.info("run completed", **{k: summary[k] for k in ("steps", "final_loss", "eval", "wall_s")})
    return summary


def _save_final(stepper: Stepper, ckpt: CheckpointerLink, summary: dict[str, Any]) -> str:
    """The final checkpoint, with the summary as far as it is known (its "eval" is empty: the final checkpoint is
    written before the final evaluation, so a crash there loses nothing); its path."""
    step, meta, tensors = stepper.snapshot()
    meta["summary"] = dict(summary)
    return ckpt.save_final((step, meta, tensors))


def _checkpointer_drops(ctx: ServiceContext) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in table(ctx.redis.hgetall(ctx.keys.ckpt_dropped)).items()}
    except redis.RedisError:
        return {}


def _set_completed(ctx: ServiceContext, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            ctx.redis.set(ctx.keys.state, "completed")
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def linger(sock: zmq.Socket, tell_stop: Callable[[bytes], None], everyone_told: Callable[[], bool],
           seconds: float) -> None:
    """Tell every worker that asks in the next moments to stop, so they exit cleanly; done as soon as every
    admitted worker has been told (workers also see the run's state in Redis, so `seconds` only bounds the wait)."""
    deadline = time.monotonic() + seconds
    while not everyone_told() and time.monotonic() < deadline:
        if sock.poll(50):
            frames = sock.recv_multipart(copy=False)
            if len(frames) >= 2:
                tell_stop(frames[0].bytes)
