"""The messages between a worker and the servers (the leader, a shard k > 0), and the coordinator's fence: their
headers declared as the package's docstring says (shared/wire/messages/__init__.py).
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from cmemi.shared.wire.messages.fields import ABSENT, Default, Worker


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
    near: Annotated[list[Any] | None, Default(None)]  # local steps, K > 1: the servers on its host (shard numbers)


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
    past: Annotated[bool, Default(False)]  # train.state_every > 1: an older version from its history, for a replay


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
    # [[k, incarnation, address], ...] of every shard k > 0, once a shard restarted within the term was taken in and
    # this worker was not told yet: it relinks before it pulls or pushes (checked: services/worker/links/shard_addrs.py)
    shards: Annotated[list[Any] | None, Default(None)]


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
    # train.state_every > 1, K > 1: no state, only the leader's pieces of the versions a replay needs (the replica's
    # state comes from the shard that keeps it)
    only_past: Annotated[bool, Default(False)]


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
    past: Annotated[bool, Default(False)]  # the answer to a pull of an older version (its history's pieces)
    refused: Annotated[str | None, Default(None)]  # past: why this shard cannot answer that version (no tensors)


# ---------------------------------------------------------------- coordinator -> aggregator
class Fence(TypedDict):
    wid: str
    inc: int
