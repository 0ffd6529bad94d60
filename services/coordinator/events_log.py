"""RUN_DIR/events.jsonl: the coordinator copies the run's Redis event stream to disk as it grows.

The file outlives Redis (an embedded Redis ends with `cmemi up`), so `cmemi status`, `cmemi events` and the
recovery measurements read a finished run from it. Redis may lose its data mid-run: the stream then starts
over from its first entry (the file keeps what was copied before).
"""

from __future__ import annotations

import json
from pathlib import Path

import redis
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import read_events

START = "0-0"  # the stream id before every entry


class EventsLog:
    def __init__(self, client: redis.Redis, keys: Keys, path: Path) -> None:
        self.client, self.keys = client, keys
        self.cursor = START
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the coordinator's life; close() closes it

    def tail(self) -> None:
        """Append the entries added since the last call. Never raises: a missed tail is caught up at the next."""
        try:
            if self.cursor != START and not self.client.exists(self.keys.events):
                self.cursor = START  # Redis lost its data: the stream starts over
            for entry_id, event in read_events(self.client, self.keys, self.cursor):
                self.cursor = entry_id
                self.file.write(json.dumps(event) + "\n")
        except (redis.RedisError, ValueError):
            pass

    def close(self) -> None:
        self.tail()
        self.file.close()
