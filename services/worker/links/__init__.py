"""What comes and goes on a worker's wire.

- `leader.py`: the socket to the leader: sending (one `want`), receiving in parts, re-asks and `pending`.
- `patience.py`: when to ask again, and what the leader's `pending` means.
- `joining.py`: find the leader, say hello, be welcomed, link to the other shards.
- `intake.py`: the leader's parameters into the model (the ways they come) and the version held.
- `inbox.py`: where the received parameters land (in place on a CPU).
- `lending.py`: a same-host leader's slot read in place, and when that is safe.
- `shard_links.py`: the other parameter-server shards: their slices asked for and waited for, the gradient's slices out.
- `landing.py`: where a shard's slice lands in the model, and its copy there (slots, downlink changes, streaming).
- `shard_link.py`: one shard's link: what it holds of a pull, and why a link is given up (`Lost`, `Moved`).
- `shard_addrs.py`: where each shard is now, from its Redis record (a shard restarted within the term).
- `outbox.py`: a lease's gradient encoded and sent to every shard.
- `inflight.py`: a big model's last gradient out of ZeroMQ's queues before the next one.
"""
