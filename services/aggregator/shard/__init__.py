"""A parameter-server shard k > 0 of `cluster.shards`: its slice of the parameters, in the leader's term.

- `server.py`: the shard's loop: workers' and its leader's messages in, each to the part that handles it.
- `stepping.py`: the shard's current step: gradients' slices in, reported to the leader, stepped at its commit.
- `join.py`: how a shard joins its leader's term: the leader found through Redis, the same checkpoint restored.
- `upstream.py`: the shard's link to its leader: what it says (`shard_join`, `shard_have`, ...) and what it hears.
- `newterm.py`: a shard that outlives its leader joins the new term in place (its process and state kept), or why not.
- `door.py`: which workers' hellos the shard answers, and when (parked until its leader's welcome, or turned away).
- `checks.py`: what a shard checks of a worker's gradient before it decodes a byte of it.
- `stages.py`: the shard's current step, stage by stage (`cluster.pipeline_stages`).
- `pulls.py`: answers to workers' pulls: each stage of the slice at the version asked for, as soon as it has it.
- `inner.py`: the states of the replicas r ≡ k mod K this shard keeps (train.inner_states: shards): checked, kept once
  their change is accepted, handed to a worker that asks (a `pull` naming the replica).
"""
