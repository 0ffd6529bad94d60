"""What the checkpointer's errors start with, for `cmemi up` to tell them apart without importing torch."""

DISK_FULL = "disk full"  # how a full-disk error starts: `cmemi up` exits 2 on it (resumable, not a failure)
