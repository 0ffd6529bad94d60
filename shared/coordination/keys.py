"""Every Redis key CMEMI uses, in one place. All live under `cmemi:{run}:`.

| key | type | written by | meaning |
|---|---|---|---|
| `incarnation` | counter | every process at start | INCR gives each process start a unique incarnation number (kept growing across Redis data loss by the coordinator, shared/coordination/counters.py) |
| `member:{role}:{id}` | hash | the process | incarnation, pid, host, started_at, state |
| `hb:{role}:{id}` | string + TTL | the process, every `heartbeat_interval` | its incarnation; expires `dead_after` after the last beat |
| `fence:{role}:{id}` | string | coordinator | incarnations <= this value are fenced (dead) |
| `aggregator` | hash | aggregator | addr (tcp://host:port), term, pid, incarnation |
| `term` | counter | aggregator at start | INCR gives each aggregator start a new term |
| `checkpointer` | hash | checkpointer | addr, pid, incarnation |
| `state` | string | coordinator / aggregator | starting, running, completed, failed |
| `error` | string | any | why the run failed (one line) |
| `error:user` | string | a service's `ctx.fatal` | set: the failure is user-fixable (config, data, user code); `cmemi up` exits 2 |
| `progress` | hash | aggregator, every step | step, total, loss, lr, samples_s, bytes_s, live_workers, term, t |
| `microbatches` | hash | aggregator, every step | accepted microbatches per `wid:incarnation` |
| `heard` | hash | leader, every heartbeat interval | per worker id: `incarnation:count` of the messages it heard from it (a second liveness channel, heard.py) |
| `events` | stream | everyone | joins, deaths, fences, restarts, checkpoints (XADD, field `json`) |
| `ckpt:latest` | string | checkpointer | step of the newest durable checkpoint |
| `ckpt:dropped` | hash | checkpointer | messages it dropped, by reason (copied into `summary.json`) |
| `spare:{id}` | list | coordinator | worker id a warm spare process should take over |
| `control:scale` | string | `cmemi scale` | requested worker count |
"""

from __future__ import annotations


class Keys:
    def __init__(self, run: str) -> None:
        p = self.prefix = f"cmemi:{run}:"
        self.incarnation = p + "incarnation"
        self.aggregator = p + "aggregator"
        self.term = p + "term"
        self.checkpointer = p + "checkpointer"
        self.state = p + "state"
        self.error = p + "error"
        self.user_error = p + "error:user"
        self.progress = p + "progress"
        self.microbatches = p + "microbatches"
        self.heard = p + "heard"
        self.events = p + "events"
        self.ckpt_latest = p + "ckpt:latest"
        self.ckpt_dropped = p + "ckpt:dropped"
        self.scale = p + "control:scale"

    def member(self, role: str, ident: str) -> str:
        return f"{self.prefix}member:{role}:{ident}"

    def heartbeat(self, role: str, ident: str) -> str:
        return f"{self.prefix}hb:{role}:{ident}"

    def spare(self, ident: str) -> str:
        """List a warm spare worker blocks on; the coordinator pushes the worker id it should become."""
        return f"{self.prefix}spare:{ident}"

    def fence(self, role: str, ident: str) -> str:
        return f"{self.prefix}fence:{role}:{ident}"
