"""Gradients an admitted worker sent that this server cannot take, counted per worker: they do not fit the model, the
codec or the replica's inner state (a bug, or another CMEMI version on that host: the hello's checks passed). A race
is not one (a stale step, a lease handed out again, a slot rewritten): only what `gradients.decode` and the buffer and
inner-state checks refuse. Dropping such a gradient silently leaves an honest worker computing, being dropped and
asking again forever; so its `LIMIT`-th in a row, with none taken between, gets a fatal reject naming the reason,
and the worker stops the run with that one line (services/worker/worker.py, `_stop_or_reject`)."""

from __future__ import annotations

LIMIT = 3
CAP = 1024  # workers tracked at most (the oldest entry goes first): identities come and go with reconnects
_REASONS = ("codec_", "grad_names", "grad_shape", "bad_losses", "bad_buffers", "bad_inner")


def misfit(reason: str) -> bool:
    """Is a drop for `reason` one that the same worker would make again (not a race)?"""
    return reason.startswith(_REASONS)


class Misfits:
    """Per admitted worker (its socket identity): how many gradients in a row were dropped as misfits, and why."""

    def __init__(self) -> None:
        self.runs: dict[bytes, int] = {}

    def dropped(self, identity: bytes, reason: str) -> bool:
        """Count a dropped gradient; True when this worker's misfits in a row reached LIMIT (reject it, fatally)."""
        if not misfit(reason):
            return False
        n = self.runs.pop(identity, 0) + 1
        if len(self.runs) >= CAP:
            del self.runs[next(iter(self.runs))]
        self.runs[identity] = n
        return n >= LIMIT

    def reject(self, identity: bytes, wid: str, reason: str, detail: str, server: str) -> str | None:
        """Count a dropped gradient; the fatal reject's reason when it is this worker's LIMIT-th misfit in a row (its
        count then starts over), else None."""
        if not self.dropped(identity, reason):
            return None
        self.forget(identity)
        return (f"{server} dropped {LIMIT} gradients in a row of worker {wid} as {reason} ({detail[:160]}): its "
                "gradients do not fit this run's model or compression; run the same CMEMI version, model code and "
                "config on every host")

    def forget(self, identity: bytes) -> None:
        """One of its gradients was taken (the run of misfits is over), or it left."""
        self.runs.pop(identity, None)
