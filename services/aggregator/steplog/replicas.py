"""The replicas' states in a step log entry (`train.local_steps`, docs/design/step-log.md, "Local steps").

With local steps an outer step's committed inputs are more than its reduced change: the leader also holds each
replica's inner state (its inner optimizer and scheduler; streaming, the replica's own parameters; with `sparse2`,
its error-feedback residual), and the round's accepted states become the states the next round starts from when the
outer step is applied (`InnerStates.advance`, services/aggregator/common/replicas.py). None of that is a function of
the checkpoint and the reduced changes: it is what the workers computed. So the leader's entry carries the states
the step makes current — `InnerStates.next` at the step (every replica's, whole rounds; streaming, only those of the
replicas that shipped a snapshot with this segment, `fragments.ships_state`) — and a replay puts them back as `next`
before it applies the step, which then advances them exactly as the dead leader did.

In the entry: the header's `replicas` ([[r, metadata, reference], ...], in replica order, shared/core/innerstate.py's
metadata) and no tensor of theirs: the states' tensors, named `i.{r}.` + the state's wire name, are in one record of
this server's state spool (statespool.py), which `reference` names, written before the entry is sent — so the
checkpointer's link carries the step's `g.` and `b.` tensors (link.py) and a few bytes a replica. Without the
checkpointer's spool (`checkpoint.step_log_spool: false`: a log held in memory only) there is no state spool either,
and the tensors travel in the entry as before ([[r, metadata], ...]). A replica whose state is None (fresh) has
empty metadata and no tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from cmemi.services.aggregator.common.replicas import InnerStates
from cmemi.services.aggregator.steplog.statespool import Lost, StateSpool
from cmemi.shared.core.innerstate import from_wire, to_wire
from cmemi.shared.wire import state

REPLICA = "i."


class EntryError(ValueError):
    """A logged entry's replica states do not hold together (a log written by another config or a damaged one)."""


def prefix(r: int) -> str:
    return f"{REPLICA}{r}."


def states_of(inner: InnerStates | None, spool: StateSpool | None = None,
              step: int = 0) -> tuple[list[list[Any]] | None, dict[str, torch.Tensor]]:
    """(the header's `replicas`, their tensors, not copied) of the states step `step`'s apply makes current: None and
    no tensor without local steps. Taken before the step is applied (it moves `next` into `current`); the tensors are
    the received states' own, which nothing changes in place (the leader only sends them on). With a `spool` they are
    written there now (before the entry is sent) and the header's items carry its reference instead: no tensor;
    without one, staging copies them with the step's other inputs."""
    if inner is None:
        return None, {}
    header: list[list[Any]] = []
    tensors: dict[str, torch.Tensor] = {}
    for r in sorted(inner.next):
        meta, own = to_wire(inner.next[r])
        header.append([r, meta])
        tensors.update({prefix(r) + n: t for n, t in own.items()})
    if spool is None or not tensors:
        return header, tensors
    ref = spool.write(step, tensors)
    return [[r, meta, ref] for r, meta in header], {}


def restore(inner: InnerStates, replicas: list[Any] | None, tensors: dict[str, torch.Tensor],
            spool: StateSpool | None = None, step: int = 0) -> None:
    """Before a replayed step `step` is applied: its logged states as `next` (`keep`), so its apply advances them as
    the dead leader's did: from the entry's tensors (cloned: a replay reuses its buffers for the next entry, reading.py)
    or read back from the `spool` record an item references. Every state is read before any is kept: a record that
    is gone raises statespool.Lost with `next` as it was (the replay stops before this step: replay.py)."""
    if replicas is None:
        raise EntryError("an entry of a local-steps run without its replicas' states (written with another config?)")
    kept: list[tuple[int, dict[str, Any] | None]] = []
    read: dict[str, dict[str, torch.Tensor]] = {}  # by reference: a step's states are one record
    for item in replicas:
        if not (isinstance(item, list) and len(item) in (2, 3) and type(item[0]) is int and 0 <= item[0] < inner.R):
            raise EntryError(f"a replica's state is logged as {str(item)[:80]}")
        r, meta = item[0], item[1]
        if len(item) == 3:
            if spool is None:
                raise Lost(f"step {step}'s states are in a state spool and this server keeps none")
            key = str(item[2])
            if key not in read:
                read[key] = spool.read(item[2], step)
            got = read[key]
            own = {n[len(prefix(r)):]: t for n, t in got.items() if n.startswith(prefix(r))}
        else:
            own = {n[len(prefix(r)):]: t.clone() for n, t in tensors.items() if n.startswith(prefix(r))}
        try:
            kept.append((r, from_wire(meta, own)))
        except state.StateError as exc:
            raise EntryError(f"replica {r}'s logged state: {exc}") from exc
    for r, s in kept:
        inner.keep(r, s)
