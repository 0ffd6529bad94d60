"""The parameter server's leader (shard 0): it leases the work, keeps the step barrier and steps the model.

- `server.py`: the receive loop, and which module each message type goes to.
- `parts.py`: the leader's collaborators, built once and passed as one.
- `leasing.py`: the lease protocol: which worker computes which node of the step's reduction tree.
- `handout.py`: the `work` message a lease carries, with the parameters in the cheapest form the worker can take.
- `grads.py`: a worker's gradient at the leader, checked in the order its checks cost: what is cheap first.
- `stepping.py`: a complete step applied once, in order: the same bits at any K.
- `roster.py`: the leader's side of sharding: the shards k > 0 of this term (a restarted one taken in it) and the
  step barrier.
- `shard_slices.py`: the shards' pieces at an evaluation step and after the last, placed into the whole model.
- `shard_messages.py`: what each message of a shard k > 0 means for the leader's own loop.
- `eval_schedule.py`: when the leader evaluates, and what early stopping decides.
- `finish.py`: the end of a run: the whole model's result, the final checkpoint, then the final evaluation.
- `reporting.py`: metrics.jsonl lines (and the trackers'), the step's traffic and codec time, the Prometheus
  gauges, the progress.
- `trackers/`: TensorBoard, MLflow and W&B (`metrics.loggers`), written off the training path.
- `progress.py`: progress for `cmemi up`'s bar and `cmemi status`, written to Redis off the loop.
- `throughput.py`: samples/s, one definition everywhere: samples trained over training wall-clock seconds.
"""
