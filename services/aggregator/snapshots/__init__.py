"""The aggregator's training state, to the checkpointer and back.

- `send.py`: snapshots of the full training state handed to the checkpointer over ZeroMQ.
- `outgoing.py`: one snapshot on its way: sent a part at a time, and copy-on-write.
- `contents.py`: what a snapshot holds, and how a checkpoint's state comes back.
- `reshard.py`: a checkpoint resumed with another `cluster.shards`.
"""
