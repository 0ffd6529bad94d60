"""The coordinator (`cmemi coordinator`): membership and liveness; with `--supervise local`, the services' parent.

- `__main__.py`: the entry point: build, run, close.
- `coordinator.py`: the loop: detect deaths (exit or missing heartbeat), fence, free leases, restart.
- `liveness.py`: a process is alive while its heartbeat key exists (a TTL of `cluster.dead_after`), or while the witnesses
  say its silence proves nothing.
- `witnesses.py`: is a missing heartbeat a death? Not while everyone fell silent at once, nor while the leader hears it.
- `fencing.py`: a process declared dead is fenced (its incarnation written to Redis) and the aggregator told.
- `run_state.py`: the run's state in Redis as the coordinator reads and ends it: running, completed or failed.
- `events_log.py`: RUN_DIR/events.jsonl: the run's Redis event stream copied to disk as it grows, each event once
  (each line carries its stream id; a restarted coordinator resumes after the last one in the file).
- `supervisor.py`: local supervision: the services as child processes, deaths and hangs noticed, restart with backoff.
- `slots.py`: one child process per service slot, and the warm spares that refill worker slots.
- `child_exit.py`: how a child's exit is read: a user error ends the run, a clean exit is not a death.
"""
