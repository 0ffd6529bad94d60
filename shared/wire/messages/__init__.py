"""Every wire message's header, declared once: its fields, their types, and what an absent optional field reads as.

Each message type is a TypedDict of its header as a handler sees it after `protocol.decode` (the envelope, `type`,
`proto` and `run`, is checked before and not repeated here). It reads like a .proto, and is both the run-time check
and what a type checker sees (`schema.of(msg.header, Work)`); shared/wire/schema.py reads `KINDS` for the check:

    x: int                              required: a message without it is dropped (`missing_field`)
    x: Annotated[int, Default(0)]       optional: absent, decode fills in 0, so a handler reads `h["x"]`
    x: Annotated[dict[str, Any], ABSENT]  optional, no default: absent stays absent (its presence says something)

A present value of another type drops the message (`bad_field`), optional fields included: a handler never tests a
type again (`h.get("ahead") is True` is `h["ahead"]`). `bool` is not an `int` here (msgpack keeps them apart, and
`True` as a step is a bug); `float` accepts an int (as a type checker does); `Any` is any value, checked by the one
reader named beside it. Fields a message declares nowhere are ignored and kept, as they always were (an older or
newer peer's extras). A default is what the handlers read for an absent field before (`h.get("have", -1)`), so a
filled-in header behaves as the sparse one did; a field whose absence means something (`"shm" in h`) has none.

torch-free (as header.py): the coordinator's `fence` never pays for importing torch. The declarations, by who talks:

- fields    what a declaration is made of (`Default`, `ABSENT`), the worker envelope, a big message's part, a tensor
- workers   worker <-> the servers (the leader, a shard k > 0), and the coordinator's fence
- servers   the aggregator <-> the checkpointer (the step log too), shard k > 0 <-> the leader
"""

from __future__ import annotations

from cmemi.shared.wire.messages.fields import ABSENT, Absent, Default, Part, Tensor, Worker
from cmemi.shared.wire.messages.servers import (
    LogEnd,
    LogEntries,
    LogEntry,
    LogGap,
    Logged,
    LogReq,
    NoCheckpoint,
    Restore,
    RestoreReq,
    Retry,
    Saved,
    ShardBehind,
    ShardCommit,
    ShardEval,
    ShardFence,
    ShardFinal,
    ShardHave,
    ShardJoin,
    ShardMember,
    ShardReady,
    ShardSnapshot,
    ShardWelcome,
    Skipped,
    Snapshot,
    StepLog,
)
from cmemi.shared.wire.messages.workers import (
    Fence,
    Grad,
    Hello,
    Inner,
    Leave,
    Parked,
    Pending,
    Pull,
    Reject,
    Slice,
    Stop,
    Want,
    Welcome,
    Work,
)

__all__ = ["ABSENT", "Absent", "Default", "Fence", "Grad", "Hello", "Inner", "KINDS", "Leave", "LogEnd", "LogEntries", "LogEntry",
    "LogGap", "LogReq", "Logged", "NoCheckpoint", "Parked", "Part", "Pending", "Pull", "Reject", "Restore",
    "RestoreReq", "Retry", "Saved", "ShardBehind", "ShardCommit", "ShardEval", "ShardFence", "ShardFinal",
    "ShardHave", "ShardJoin", "ShardMember", "ShardReady", "ShardSnapshot", "ShardWelcome", "Skipped", "Slice",
    "Snapshot", "StepLog", "Stop", "Tensor", "Want", "Welcome", "Work", "Worker"]

# type -> its declaration, in the order the types were first declared (a seeded fuzz corpus draws from this order)
KINDS: dict[str, type] = {
    "hello": Hello, "want": Want, "grad": Grad, "leave": Leave, "welcome": Welcome, "work": Work, "stop": Stop,
    "reject": Reject, "inner": Inner, "pending": Pending, "parked": Parked, "fence": Fence,
    "snapshot": Snapshot, "saved": Saved, "skipped": Skipped, "retry": Retry, "restore_req": RestoreReq,
    "restore": Restore, "no_checkpoint": NoCheckpoint, "pull": Pull, "slice": Slice,
    "shard_join": ShardJoin, "shard_have": ShardHave, "shard_ready": ShardReady, "shard_commit": ShardCommit,
    "shard_welcome": ShardWelcome, "shard_fence": ShardFence, "shard_eval": ShardEval, "shard_final": ShardFinal,
    "part": Part, "step_log": StepLog, "logged": Logged, "log_gap": LogGap, "log_req": LogReq,
    "log_entry": LogEntry, "log_end": LogEnd, "shard_snapshot": ShardSnapshot, "shard_behind": ShardBehind,
    "log_entries": LogEntries,
}
