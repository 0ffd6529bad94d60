"""A worker (`cmemi worker`): pull a lease, compute its gradient, send it, repeat.

- `__main__.py`: the entry point: build, (as a spare) wait for an identity, run, close.
- `worker.py`: wires the pieces; the loop: each message to its handler by type, and what to do while none comes.
- `lease.py`: one lease of work in named steps: parameters in, gradient computed, sent, what comes after.
- `residual.py`: the codec's error-feedback state rewound when a step it encoded is asked of it again (a new term).
- `lifecycle.py`: who the worker is (registration, heartbeat) and when it exits (run over, fenced).
- `compute/`: what a lease computes (microbatches, blocks, local steps, the device, data loaders).
- `links/`: what comes and goes on the wire (the leader, the other shards, shared-memory slots).
"""
