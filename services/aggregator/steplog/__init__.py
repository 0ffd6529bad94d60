"""The step log, a server's side (docs/design.md §11): no committed step is trained twice.

- `connection.py`: the connection to the checkpointer's step log socket: where it is, sends that never wait, replies.
- `link.py`: each step's inputs shipped to the checkpointer before its optimizer step; the step commits on the ack.
- `staging.py`: a step's inputs copied for its entry: into a shared-memory slot (the checkpointer on this host) or
  buffers kept from step to step.
- `evals.py`: early stopping's state in the log: the evaluations collected before each step, loaded on a replay.
- `reading.py`: a replay's entries read from the checkpointer in order, two requested ahead.
- `replicas.py`: with train.local_steps, the replicas' states an outer step makes current, referenced by the server's
  entry (or in it) and put back before a replayed step.
- `statespool.py`: with train.local_steps, the replicas' states a step makes current, written to this server's own
  host (one record a step) so that its entry carries a reference, not the tensors, through the checkpointer's link.
- `replay.py`: a restarted server replays the log after its checkpoint: optimizer steps only, bitwise the same.
- `frames.py`: an entry as the step's encoded gradients as they came (a compressing codec, where fewer bytes than the
  reduced slice), reduced again on a replay by the live step's decode and reduction tree.
- `shard.py`: a shard k > 0's side (cluster.shards > 1): its slice's entry shipped with its `shard_ready`, kept until
  logged, and its replay with the leader's decisions.
"""
