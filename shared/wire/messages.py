"""Every wire message's header, declared once: its fields, their types, and what an absent optional field reads as.

Each message type is a TypedDict of its header as a handler sees it after `protocol.decode` (the envelope, `type`,
`proto` and `run`, is checked before and not repeated here). It reads like a .proto, and is both the run-time check
and what a type checker sees (`schema.of(msg.header, Work)`); shared/wire/schema.py reads it for the check:

    x: int                              required: a message without it is dropped (`missing_field`)
    x: Annotated[int, Default(0)]       optional: absent, decode fills in 0, so a handler reads `h["x"]`
    x: Annotated[dict[str, Any], ABSENT]  optional, no default: absent stays absent (its presence says something)

A present value of another type drops the message (`bad_field`), optional fields included: a handler never tests a
type again (`h.get("ahead") is True` is `h["ahead"]`). `bool` is not an `int` here (msgpack keeps them apart, and
`True` as a step is a bug); `float` accepts an int (as a type checker does); `Any` is any value, checked by the one
reader named beside it. Fields a message declares nowhere are ignored and kept, as they always were (an older or
newer peer's extras). A default is what the handlers read for an absent field before (`h.get("have", -1)`), so a
filled-in header behaves as the sparse one did; a field whose absence means something (`"shm" in h`) has none.

torch-free (as header.py): the coordinator's `fence` never pays for importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypedDict


@dataclass(frozen=True)
class Default:
    """An optional field: absent on the wire, decode fills in `value` (copied: a list default is never shared)."""
    value: Any


class Absent:
    """An optional field without a default: absent on the wire, it stays absent (`"shm" in h` tells)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = Absent()


class Worker(TypedDict):
    wid: str
    inc: int


# ---------------------------------------------------------------- worker -> aggregator (the leader, or a shard k > 0)
class Hello(Worker):
    fp: dict[str, Any]
    host: str
    env: Annotated[dict[str, Any] | None, Default(None)]  # its environment (admission.py: None is "an older cmemi")
    shm: Annotated[bool, Default(False)]  # it asks for shared-memory slots (it came over ipc://)


class Want(Worker):
    term: int
    version: int
    reask: Annotated[int, Default(0)]  # n > 0: asked again after silence (leader/leasing.py)
    holds: Annotated[list[Any] | None, Default(None)]  # local steps: [[replica, round], ...] of its inner states


class Grad(Worker):
    term: int
    step: int
    lo: int
    hi: int
    version: int
    losses: list[Any]
    n: int
    finite: bool
    codec: dict[str, Any]
    encode_s: float
    tensors: list[Any]
    lease: Annotated[bytes, Default(b"")]  # the leader's seal of its lease: a shard checks it (admission.py)
    stage: Annotated[int, Default(0)]  # cluster.pipeline_stages: which stage of a shard's slice it carries
    ahead: Annotated[bool, Default(False)]  # streaming: computed before its lease (its time says nothing of compute's)
    inner: Annotated[dict[str, Any] | None, Default(None)]  # local steps: the replica's inner state's meta
    holds: Annotated[list[Any] | None, Default(None)]  # as want's
    shm: Annotated[Any, ABSENT]  # a slot descriptor instead of frames (checked by shared/memory/shm.py: shm_bad)


class Leave(Worker):
    pass


class Pull(Worker):  # to shard k > 0: that version's slice
    term: int
    version: int
    have: Annotated[int, Default(-1)]  # the version it holds (compression.downlink: a change from it will do)
    replica: Annotated[int | None, Default(None)]  # train.inner_states: shards: that replica's state instead (`inner`)


# ---------------------------------------------------------------- aggregator -> worker
class Welcome(TypedDict):
    term: int
    step: int
    version: int
    total_steps: int
    shards: Annotated[list[Any], Default([])]  # the leader's: every shard k > 0's address
    shm: Annotated[bool, Default(False)]  # slots granted (parameters and gradients go through shared memory)


class Work(TypedDict):
    term: int
    step: int
    lo: int
    hi: int
    version: int
    scale: float
    tensors: list[Any]
    lease: Annotated[bytes, Default(b"")]  # its seal: the worker sends it back with the gradient, to every shard
    downlink: Annotated[str | None, Default(None)]  # "dense", "delta" (from `base`) or "pieces" (streaming)
    base: Annotated[int | None, Default(None)]  # the version a delta or the pieces are from
    codec: Annotated[dict[str, Any] | list[Any] | None, Default(None)]  # a delta's encoding; a chain of deltas: a list
    last: Annotated[bool, Default(False)]  # streaming: its last lease of the step, so it computes ahead once sent
    layout: Annotated[str | None, Default(None)]  # the digest of the flat frames' layout (shared/wire/layout.py)
    shm: Annotated[Any, ABSENT]  # the parameters' slot descriptor instead of frames (checked by shared/memory/shm.py)


class Stop(TypedDict):
    reason: str


class Reject(TypedDict):
    reason: str
    fatal: bool


class Inner(TypedDict):  # a replica's state at a round's start, ahead of its `work` or for a pull (meta: state.py's)
    replica: int
    round: int
    meta: dict[str, Any]
    tensors: list[Any]


class Pending(TypedDict):  # re-ask n came while the work last sent is unanswered (leader/leasing.py)
    reask: int


class Parked(TypedDict):
    """Streaming: no lease for the worker now after its grad of step `step`, so it may compute its replicas' next
    segments ahead (services/worker/compute/replicas.py, docs/design.md §10)."""
    step: int


class Slice(TypedDict):  # shard k > 0's answer to a pull
    version: int
    asked: int  # the pull's version
    shard: int
    tensors: list[Any]
    stage: Annotated[int, Default(0)]  # cluster.pipeline_stages: one per stage; -1: that step is over, no tensors
    downlink: Annotated[str | None, Default(None)]  # as work's
    base: Annotated[int | None, Default(None)]
    codec: Annotated[dict[str, Any] | list[Any] | None, Default(None)]  # as work's
    shm: Annotated[Any, ABSENT]  # as work's


# ---------------------------------------------------------------- coordinator -> aggregator
class Fence(TypedDict):
    wid: str
    inc: int


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


class LogEntry(StepLog):  # the answer to a log_req (its `term` is the requester's)
    pass


class LogEnd(TypedDict):  # no entry after `after`: the replay is over
    after: int


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


# ---------------------------------------------------------------- transfer
class Part(TypedDict):
    """One part of a logical message too big for one ZeroMQ message (shared/wire/transfer.py)."""
    xfer: int
    index: int
    count: int
    frames: list[Any]
    of: Annotated[Any, ABSENT]  # part 0's: the logical header (checked by shared/wire/assembly.py: bad_part)


class Tensor(TypedDict):
    """One entry of a header's `tensors`."""
    name: str
    dtype: str
    shape: list[Any]
    nbytes: int
    xxh: int | None


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
}
