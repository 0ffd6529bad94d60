"""What a worker computes; nothing here touches a socket.

- `microbatch.py`: one microbatch's gradient (`MicrobatchRunner`), user code's errors told apart.
- `block.py`: a lease of microbatches summed in the reduction tree's order (`BlockComputer`); the heap trimmed first.
- `local.py`: train.local_steps: a replica's round of inner steps (`LocalRound`).
- `replicas.py`: the replicas' inner states held, and rounds computed ahead (streaming).
- `device.py`: which GPU a worker id takes, and the determinism settings it needs.
- `loader.py`: data loader processes that read microbatches ahead, with the same bits.
"""
