"""The rules that make a step's result the same bits at any worker count, shard count or failure.

- data        which samples form microbatch (s, m): a pure function of (seed, epoch, s, m)
- reduction   the one summation rule: a fixed balanced binary tree over microbatches
- grid        the chunk grid of the parameters and its partition over K shards
- buffers     the one rule that folds a step's microbatch buffers (BatchNorm statistics) into the model
- environment what changes a gradient's bits besides the data, said in a worker's hello
- fragments   Streaming DiLoCo's fragments: which pieces each holds and when it syncs
- innerstate  a replica's inner optimizer and scheduler state on the wire
- history     the versions of θ a replica's replay starts its rounds from (train.state_every > 1)
"""
