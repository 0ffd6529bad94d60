"""RUN_DIR/events.jsonl: the coordinator copies the run's Redis event stream to disk as it grows, each event once.

The file outlives Redis (an embedded Redis ends with `cmemi up`), so `cmemi status`, `cmemi events` and the
recovery measurements read a finished run from it. Redis may lose its data mid-run: the stream then starts
over from its first entry (the file keeps what was copied before).

Each line carries its stream entry id (`sid`), and a coordinator that starts (a restart after a SIGKILL) resumes
after the last id in the file, read from the file's tail (one block from the end: a long run's file is never read
whole). Before, the cursor started at 0-0 and the whole stream was appended again after every restart (one run
held 1,805 lines for 702 events). The file is the cursor on purpose: an event and the record that it was copied
are one write, so no crash falls between them; a cursor kept in Redis would be a second write (a crash between
the two copies an event twice) and would vanish with the stream it points into. A line torn by a SIGKILL in the
middle of a write is cut off at start (its event is copied again, whole).

A stream that started over (Redis lost its data) is noticed two ways: the key is gone while we tail (the cursor
goes back to 0-0), or, at a start, the stream's newest id is below the file's last one (stream ids are the Redis
host's milliseconds, so a new stream's ids are normally above the old ones and the plain cursor reads them all).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import cast

import redis
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import read_events

START = "0-0"  # the stream id before every entry
ID_FIELD = "sid"  # each line's stream entry id
TAIL_BLOCK = 64 * 1024  # bytes read from the end of the file per look for the last id


def stream_id(text: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as a comparable pair."""
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def drop_torn_line(path: Path) -> None:
    """Cut a last line that has no newline (the writer was killed in the middle of it)."""
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - TAIL_BLOCK)
            f.seek(start)
            block = f.read(end - start)
            if end == size and block.endswith(b"\n"):
                return
            cut = block.rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            end = start
        f.truncate(0)


def last_copied(path: Path) -> str:
    """The stream id of the file's last line that has one (START for none), reading the file from its end."""
    if not path.is_file():
        return START
    drop_torn_line(path)
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        carry = b""
        while end > 0:
            start = max(0, end - TAIL_BLOCK)
            f.seek(start)
            data = f.read(end - start) + carry
            lines = data.split(b"\n")
            carry = lines[0] if start > 0 else b""  # may be cut: completed by the next block back
            for line in reversed(lines[1:] if start > 0 else lines):
                sid = _sid_of(line)
                if sid is not None:
                    return sid
            end = start
    return START


def _sid_of(line: bytes) -> str | None:
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    sid = row.get(ID_FIELD) if isinstance(row, dict) else None
    return sid if isinstance(sid, str) else None


class EventsLog:
    def __init__(self, client: redis.Redis, keys: Keys, path: Path) -> None:
        self.client, self.keys = client, keys
        self.cursor = last_copied(path)
        self.resumed = self.cursor != START  # checked against the stream once Redis answers (see `_check_resumed`)
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the coordinator's life; close() closes it

    def tail(self) -> None:
        """Append the entries added since the last call. Never raises: a missed tail is caught up at the next."""
        try:
            if self.resumed:
                self._check_resumed()
            if self.cursor != START and not self.client.exists(self.keys.events):
                self.cursor = START  # Redis lost its data: the stream starts over
            for entry_id, event in read_events(self.client, self.keys, self.cursor):
                self.cursor = entry_id
                self.file.write(json.dumps({**event, ID_FIELD: entry_id}) + "\n")
        except (redis.RedisError, ValueError):
            pass

    def _check_resumed(self) -> None:
        """A resumed cursor above the stream's newest entry points into a stream that is gone: start over."""
        newest = cast("list[tuple[str, dict[str, str]]]", self.client.xrevrange(self.keys.events, count=1))  # decoded
        if newest and stream_id(newest[0][0]) < stream_id(self.cursor):
            self.cursor = START
        self.resumed = False

    def close(self) -> None:
        self.tail()
        self.file.close()
