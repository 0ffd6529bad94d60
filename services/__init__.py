"""The CMEMI services (installed as `cmemi.services`); each runs as its own process and none imports another.

- aggregator/    the parameter server: the leader (shard 0), the shards k > 0, and the snapshots they send
- worker/        pulls a lease, computes its gradient, sends it, repeats
- checkpointer/  writes the aggregator's snapshots durably and sends them back on restore
- coordinator/   membership and liveness: detects deaths, fences, frees leases, restarts (`--supervise local`)
"""
