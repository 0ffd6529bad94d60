"""metrics.jsonl, which the leader of each term appends to: a step's line written once, whichever leader writes it.

Two leaders can append at once: a deposed one (cut from Redis, it still takes the checkpointer's ack of the step it
had shipped, and logs it) and its successor, which replays that step from the log and writes the line of each
replayed step past the file's last step line (steplog/replay.py). Read once when the replay starts, that last line
misses the deposed leader's line if it comes a moment later, and the deposed leader's line may come after the
successor's: the step then had two lines (tests/test_partitions.py, partition (b): the same loss twice). So each line
is appended under an exclusive lock on the file (flock: the leaders share a host, or a file system that honours it),
after a check against what the other writers appended since this one's last line:

- a replayed step's line is not written if the file's last step line is at or past it (its leader logged it after
  all);
- a leader's step line is not written if a newer term's leader has written a line at or past that step: the newer
  term holds the step, committed and logged (the deposed leader's ack came after it lost its term).

A newer term's lines of steps it trains again after going back to a checkpoint are written (new results of the
step, counted as redone), and a deposed leader's line past what the newer term wrote still is (the fencing checks of
tests/helpers/netns_checks.py must see it). Another writer is noticed by the file's size: unchanged since this
writer's last line, nothing is read (a flock and an fstat per line).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

TAIL = 1 << 16  # bytes of the file's end read to find the other writers' last lines (~250 lines)


class MetricsFile:
    def __init__(self, path: Path, term: int) -> None:
        self.path, self.term = path, term
        self.f = open(path, "a", buffering=1)
        self.size = -1  # the file's size after this writer's last line (-1: none written yet)

    def append(self, line: dict[str, Any], replayed: bool = False) -> bool:
        """Write `line` (a step's, or an evaluation's: with `eval`) unless the file holds its step already (see the
        module's docstring; `replayed`: the line of a step replayed from the log). True if it was written."""
        fd = self.f.fileno()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if "eval" not in line and os.fstat(fd).st_size != self.size and self._held(int(line["step"]), replayed):
                return False
            self.f.write(json.dumps(line) + "\n")
            self.f.flush()
            self.size = os.fstat(fd).st_size
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _held(self, step: int, replayed: bool) -> bool:
        for entry in reversed(_tail(self.path)):  # the newest first
            if replayed:
                return step <= entry["step"]  # the last step line
            if entry.get("term", -1) > self.term:
                return step <= entry["step"]  # the newest line of a newer term
        return False

    def close(self) -> None:
        self.f.close()


def _tail(path: Path) -> list[dict[str, Any]]:
    """The step lines (not evaluations') among the last TAIL bytes of the file, in order."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL))
        lines = f.read().decode(errors="replace").splitlines()
    out = []
    for text in lines:
        try:
            entry = json.loads(text)
        except ValueError:
            continue  # the tail's first line, cut; or one a SIGKILL cut short
        if isinstance(entry, dict) and "loss" in entry and "eval" not in entry and isinstance(entry.get("step"), int):
            out.append(entry)
    return out
