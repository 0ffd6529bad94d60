"""What a run has done so far, across aggregator terms: the loss of its last step, the bytes it moved and its
training wall time. Carried in every snapshot, so a restarted aggregator goes on counting where the last left off."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cmemi.shared.compression.downlink import DELTA, DENSE
from cmemi.shared.core.fragments import PIECES


@dataclass
class RunTotals:
    final_loss: float = float("nan")
    bytes_in: int = 0  # every gradient byte workers sent, accepted or not
    bytes_out: int = 0  # every work message byte sent to workers
    slot_in: int = 0  # of bytes_in, those that came through shared-memory slots (shared/memory/shm.py), not the socket
    slot_out: int = 0  # of bytes_out, likewise
    duplicate_param_sends: int = 0  # parameters of a version sent again to the same worker (services/aggregator/leader/leasing.py)
    inner_states_sent: int = 0  # local steps: replicas' inner states sent to a worker that did not hold them (moved)
    inner_rounds_replayed: int = 0  # train.state_every > 1: rounds a moved replica's new holder computes again
    segments_ahead: int = 0  # streaming local steps: accepted segments their worker had computed before the lease
    changes_sent: int = 0  # compression.downlink: parameter changes (or chains of them) sent to workers; streaming:
    # messages of only the pieces changed since the worker's version
    mirrors_sent: int = 0  # compression.downlink: whole mirrors sent (a new worker, or one too far behind)
    wall_before: float = 0.0  # training seconds of earlier terms
    t_start: float | None = None  # when this term handed out its first lease (monotonic)

    def sent(self, fields: dict) -> None:
        """Count a work or slice message's parameters by what `downlink` it carries (none: not counted)."""
        if (kind := fields.get("downlink")) is not None:
            self.changes_sent += kind in (DELTA, PIECES)
            self.mirrors_sent += kind == DENSE

    def replayed(self, emit: Callable[..., None], replica: int, first: int, now: int) -> None:
        """train.state_every > 1: replica `replica`'s new holder computes rounds `first` … `now` − 1 again (from its
        snapshot's round): counted, and a `replay` event through `emit(kind, **fields)`; nothing when first == now."""
        if first < now:
            self.inner_rounds_replayed += now - first
            emit("replay", replica=replica, first=first, round=now, rounds=now - first)

    def started(self, now: float) -> bool:
        """Mark this term's training start; True the first time."""
        if self.t_start is None:
            self.t_start = now
            return True
        return False

    def wall_s(self) -> float:
        """Training wall time of the whole run, earlier terms included."""
        return self.wall_before + (time.monotonic() - self.t_start if self.t_start is not None else 0.0)

    def state_dict(self) -> dict[str, float | int]:
        return {"final_loss": self.final_loss, "bytes_sent": self.bytes_in, "bytes_received": self.bytes_out,
                "bytes_sent_via_slots": self.slot_in, "bytes_received_via_slots": self.slot_out,
                "wall_s": self.wall_s(), "duplicate_param_sends": self.duplicate_param_sends,
                "inner_states_sent": self.inner_states_sent, "segments_ahead": self.segments_ahead,
                "changes_sent": self.changes_sent,
                "mirrors_sent": self.mirrors_sent,
                **({"inner_rounds_replayed": self.inner_rounds_replayed} if self.inner_rounds_replayed else {})}

    def load_state_dict(self, sd: dict[str, float | int]) -> None:
        self.final_loss = float(sd["final_loss"])
        self.bytes_in, self.bytes_out = int(sd["bytes_sent"]), int(sd["bytes_received"])
        self.wall_before = float(sd["wall_s"])
        self.duplicate_param_sends = int(sd.get("duplicate_param_sends", 0))
        self.inner_states_sent = int(sd.get("inner_states_sent", 0))
        self.segments_ahead = int(sd.get("segments_ahead", 0))
        self.inner_rounds_replayed = int(sd.get("inner_rounds_replayed", 0))
        self.changes_sent, self.mirrors_sent = int(sd.get("changes_sent", 0)), int(sd.get("mirrors_sent", 0))
        self.slot_in, self.slot_out = int(sd.get("bytes_sent_via_slots", 0)), int(sd.get("bytes_received_via_slots", 0))  # (checkpoints from before it was kept)
