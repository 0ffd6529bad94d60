"""Incarnations and terms only ever grow, whatever happens to Redis, and never from a wall clock.

The source is Redis INCR (durable through the AOF `cmemi up` gives its embedded Redis), plus the highest
value ever seen, kept by the coordinator in RUN_DIR/counters.json. Redis may come back behind that (it
restarted empty, or its AOF lost the last second of writes): the coordinator then moves the counter past
the highest known value by GAP, more than the starts that could have happened before it noticed.
"""

from __future__ import annotations

import json
from pathlib import Path

import redis
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.runtime import atomic

GAP = 1000

_RAISE_TO = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
if v < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return v
"""


class Counters:
    def __init__(self, path: Path, client: redis.Redis, keys: Keys) -> None:
        self.path, self.client = path, client
        self.keys = [keys.incarnation, keys.term]
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
        self.known = {k: int(saved.get(k, 0)) for k in self.keys}
        self.written = dict(self.known)

    def check(self) -> list[str]:
        """Raise counters Redis lost past the highest known; remember new highs. Returns the keys restored."""
        restored = []
        for key, value in zip(self.keys, self.client.mget(self.keys), strict=True):
            current = int(value) if value is not None else 0
            if current < self.known[key]:
                current = self.known[key] + GAP
                self.client.eval(_RAISE_TO, 1, key, str(current))
                restored.append(key)
            self.known[key] = max(self.known[key], current)
        if self.known != self.written:
            atomic.write_text(self.path, json.dumps(self.known))
            self.written = dict(self.known)
        return restored
