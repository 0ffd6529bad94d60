"""The replicas' states in a step log entry (`train.local_steps`, docs/design/step-log.md, "Local steps").

With local steps an outer step's committed inputs are more than its reduced change: the leader also holds each
replica's inner state (its inner optimizer and scheduler; streaming, the replica's own parameters; with `sparse2`,
its error-feedback residual), and the round's accepted states become the states the next round starts from when the
outer step is applied (`InnerStates.advance`, services/aggregator/common/replicas.py). None of that is a function of
the checkpoint and the reduced changes: it is what the workers computed. So the leader's entry carries the states
the step makes current — `InnerStates.next` at the step (every replica's, whole rounds; streaming, only those of the
replicas that shipped a snapshot with this segment, `fragments.ships_state`) — and a replay puts them back as `next`
before it applies the step, which then advances them exactly as the dead leader did.

In the entry: the header's `replicas` ([[r, metadata], ...], in replica order, shared/core/innerstate.py's metadata)
and tensors named `i.{r}.` + the state's wire name, beside the step's `g.` and `b.` tensors (link.py). A replica
whose state is None (fresh) has empty metadata and no tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from cmemi.services.aggregator.common.replicas import InnerStates
from cmemi.shared.core.innerstate import from_wire, to_wire
from cmemi.shared.wire import state

REPLICA = "i."


class EntryError(ValueError):
    """A logged entry's replica states do not hold together (a log written by another config or a damaged one)."""


def prefix(r: int) -> str:
    return f"{REPLICA}{r}."


def states_of(inner: InnerStates | None) -> tuple[list[list[Any]] | None, dict[str, torch.Tensor]]:
    """(the header's `replicas`, their tensors, not copied) of the states step's apply makes current: None and no
    tensor without local steps. Taken before the step is applied (it moves `next` into `current`); the tensors are
    the received states' own, which nothing changes in place (the leader only sends them on), and staging copies them
    with the step's other inputs."""
    if inner is None:
        return None, {}
    header: list[list[Any]] = []
    tensors: dict[str, torch.Tensor] = {}
    for r in sorted(inner.next):
        meta, own = to_wire(inner.next[r])
        header.append([r, meta])
        tensors.update({prefix(r) + n: t for n, t in own.items()})
    return header, tensors


def restore(inner: InnerStates, replicas: list[Any] | None, tensors: dict[str, torch.Tensor]) -> None:
    """Before a replayed step is applied: its logged states as `next` (`keep`), so its apply advances them as the
    dead leader's did. The tensors are cloned: a replay reuses its buffers for the next entry (reading.py)."""
    if replicas is None:
        raise EntryError("an entry of a local-steps run without its replicas' states (written with another config?)")
    for item in replicas:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and 0 <= item[0] < inner.R):
            raise EntryError(f"a replica's state is logged as {str(item)[:80]}")
        r, meta = item
        own = {n[len(prefix(r)):]: t.clone() for n, t in tensors.items() if n.startswith(prefix(r))}
        try:
            inner.keep(r, from_wire(meta, own))
        except state.StateError as exc:
            raise EntryError(f"replica {r}'s logged state: {exc}") from exc

