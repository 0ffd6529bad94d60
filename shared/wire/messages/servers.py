"""The messages among the servers: the aggregator and the checkpointer (snapshots, restores, the step log), and shard
k > 0 and shard 0 (the leader); their headers declared as the package's docstring says
(shared/wire/messages/__init__.py).
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from cmemi.shared.wire.messages.fields import ABSENT, Default


# ---------------------------------------------------------------- aggregator <-> checkpointer
class Snapshot(TypedDict):
    step: int
    term: int
    final: bool
    meta: dict[str, Any]
    tensors: list[Any]
    shard: Annotated[int, Default(0)]  # a sharded run's: whose slice it is
    shards: Annotated[int, ABSENT]  # present: a slice of a sharded run (checkpointer/merge.py checks the three)
    pieces: Annotated[dict[str, Any], ABSENT]  # piece -> [tensor, first row, end row]


class Saved(TypedDict):
    step: int
    path: str


class Skipped(TypedDict):  # a shard's snapshot of a step that will never be complete (a newer one came)
    step: int


class Retry(TypedDict):  # a snapshot the checkpointer could not check, its term unknown: send it again
    step: int


class RestoreReq(TypedDict):
    term: int
    step: Annotated[int | None, Default(None)]  # exactly that checkpoint (a shard k > 0: its leader's); None: latest
    shard: Annotated[int, Default(0)]
    pid: Annotated[int | None, Default(None)]  # a shard k > 0's process: one restore per process and term
    owned: Annotated[list[Any] | None, Default(None)]  # its pieces' names: the others' state is left out


class Restore(TypedDict):
    step: int
    meta: dict[str, Any]
    tensors: list[Any]


class NoCheckpoint(TypedDict):
    term: int


# ---------------------------------------------------------------- a server <-> the checkpointer: the step log
class StepLog(TypedDict):
    """A committed step's inputs that are no function of the step and the checkpoint (checkpointer/steplog.py)."""
    step: int  # the step these inputs make (the server's step after applying them)
    term: int
    shard: Annotated[int, Default(0)]
    skip: bool  # an fp16 overflow: optimizer.step() skipped, the loss scale backs off
    loss: float
    partials: Annotated[list[Any] | None, Default(None)]  # sharded: every shard's norm partials, as committed
    evals: Annotated[dict[str, Any] | None, Default(None)]  # evaluations collected before it: early stopping's state
    replicas: Annotated[list[Any] | None, Default(None)]  # local steps: [[r, meta, its state spool's record]]
    # the step's encoded gradients as they came instead of its reduced slice: {microbatches, parts: [[lo, hi, finite,
    # losses, codec info]]}, part i's frames the tensors f"f{i}.{name}" (services/aggregator/steplog/frames.py)
    encoded: Annotated[dict[str, Any] | None, Default(None)]
    tensors: list[Any]
    shm: Annotated[Any, ABSENT]  # same host: the tensors' slot descriptor instead of frames (shared/memory/shm.py)


class Logged(TypedDict):  # the entry of `step` is held: the step may commit
    step: int


class LogGap(TypedDict):  # not held: the log has no run from its checkpoint to it (a restart); checkpoint now
    step: int
    base: int


class LogReq(TypedDict):  # a restarted server, after restoring step `after`: the entry of step after + 1
    term: int
    after: int
    shard: Annotated[int, Default(0)]
    shm: Annotated[bool, Default(False)]  # same host: the entries' tensors in the checkpointer's slots
    cut: Annotated[bool, Default(False)]  # it replays no further (its state spool lost a step): every entry past goes
    count: Annotated[int, Default(1)]  # > 1: the entries after + 1 .. after + count in one `log_entries` (same host)


class LogEntry(StepLog):  # the answer to a log_req (its `term` is the requester's)
    pass


class LogEnd(TypedDict):  # no entry after `after`: the replay is over
    after: int


class LogEntries(TypedDict):  # the answer to a log_req with count > 1: consecutive entries from after + 1, in one slot
    after: int
    entries: list[Any]  # each entry's log_entry fields (checked as one by the reader), in step order
    end: bool  # the log holds no entry after the last of these: the replay is over there
    tensors: list[Any]  # entry i's tensors named f"{i}/{name}"
    shm: Annotated[Any, ABSENT]  # same host: the tensors' slot descriptor instead of frames


# ---------------------------------------------------------------- shard k > 0 <-> shard 0 (the leader)
class ShardMember(TypedDict):
    shard: int
    inc: int
    term: int
    step: int


class ShardJoin(ShardMember):
    addr: str


class ShardHave(ShardMember):  # which microbatches of the step it holds while the step is incomplete
    have: list[Any]


class ShardReady(ShardMember):  # a complete step: its share of the global gradient norm, its overflow flag
    partials: list[Any]
    overflow: bool


class ShardCommit(TypedDict):
    """Apply the step with every shard's share. last: the run ends with this step, every shard writes its final
    slice; snapshot: every shard checkpoints this step (the leader picks the same steps for all)."""
    term: int
    step: int
    partials: list[Any]
    skip: bool
    last: bool
    snapshot: bool


class ShardWelcome(TypedDict):
    """The run's dataset fingerprint and this term's lease-seal key, so a shard admits workers and checks leases by
    the leader's rule (services/aggregator/common/admission.py)."""
    term: int
    fp: dict[str, Any]
    lease_key: bytes


class ShardFence(TypedDict):
    term: int
    wid: str
    inc: int


class ShardSnapshot(TypedDict):  # checkpoint `step` now: the step log's forced checkpoint (a checkpointer restart)
    term: int
    step: int


class ShardBehind(TypedDict):  # a restarted shard joined short of the leader's `step`: replay on to it, join again
    term: int
    step: int


class ShardEval(ShardMember):  # its slice at eval.every_steps
    tensors: list[Any]


class ShardFinal(ShardMember):
    bytes_in: int
    bytes_out: int
    drops: dict[str, Any]
    tensors: list[Any]
    mirror: Annotated[dict[str, Any] | None, Default(None)]  # compression.downlink: its mirror pieces' SHA-256
    slot_in: Annotated[int, ABSENT]  # its totals (absent: not reported)
    slot_out: Annotated[int, ABSENT]
    changes_sent: Annotated[int, ABSENT]
    mirrors_sent: Annotated[int, ABSENT]
    inner_states_sent: Annotated[int, ABSENT]  # train.inner_states: shards: its replicas' states sent to workers
    inner_rounds_replayed: Annotated[int, ABSENT]  # train.state_every > 1: rounds its replicas' new holders replay
