"""The checkpointer (`cmemi checkpointer`, on the host that owns the disk): snapshots in, durable checkpoints out.

- `__main__.py`: the entry point: build, run, close.
- `server.py`: the loop: receive snapshots, write them durably, move the `latest` pointer, enforce retention.
- `admission.py`: what it accepts: only the current aggregator term's snapshots, with a well-formed meta.
- `spool.py`: a snapshot's tensor bytes on disk as they arrive, so a whole snapshot is never held in memory.
- `safetensors_out.py`: safetensors files written from byte ranges (its copy of `safetensors.torch.save_file`).
- `steplog.py`: the step log: each server's committed steps' inputs, held until a checkpoint covers them.
- `logserver.py`: the step log's own socket and thread, so an acknowledgement never waits on a write or on Redis.
- `logfiles.py`: the step log written through to segment files, read back (checked, a torn tail cut) after a restart.
- `steplog_replies.py`: its messages: an entry held and acknowledged, a replay answered one entry at a time.
- `merge.py`: one logical checkpoint of a sharded run: every shard's slice of a step, merged.
- `diskfull.py`: a full disk while writing: retention once, one more try, then one clear line and a clean stop.
- `store.py`: checkpoints on disk: atomic writes, manifests with checksums, verification and retention.
- `restore.py`: a checkpoint sent back from its files (a `restore` reply), a part at a time.
- `drops.py`: dropped messages counted by reason, not logged one by one, and mirrored to Redis.
- `errors.py`: what its errors start with, for `cmemi up` to tell them apart without importing torch.
"""
