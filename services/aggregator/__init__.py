"""The aggregator (parameter server): `cmemi aggregator --config RUN_DIR/config.yaml`.

- `__main__.py`: the entry point: the leader (shard 0) or a shard k > 0, as `cluster.shards` and the shard flag say.
- `leader/`: shard 0: leases, the step barrier, the optimizer step, evaluation, the end of the run.
- `shard/`: a shard k > 0 of `cluster.shards`: its slice of the parameters, joined to the leader's term.
- `common/`: what the leader and every shard share: admission, intake, gradients, the trainer, publishing.
- `snapshots/`: the aggregator's training state sent to the checkpointer, restored, and resharded.
"""
