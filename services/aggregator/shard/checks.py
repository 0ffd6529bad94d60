"""What a shard k > 0 checks of a worker's gradient before it decodes a byte of it (docs/design.md §4).

The lease's seal first: a forgery is one whatever its step (a stale honest gradient has a valid seal), so a
gradient whose lease the leader did not hand this worker counts as `forged_lease`, never as `stale_step`. Then
the step, the reduction tree's node and (pipelined) the stage: each cheap, so a wrong gradient costs little.
"""

from __future__ import annotations

from typing import Any

from cmemi.services.aggregator.common.admission import LeaseSeal
from cmemi.shared.core import reduction


def where(h: dict[str, Any]) -> str:
    """How a gradient is named in a drop's detail."""
    return f"{h['wid']}: step {h['step']} microbatches [{h['lo']}, {h['hi']})"


def refusal(h: dict[str, Any], seal: LeaseSeal | None, term: int, version: int, microbatches: int,
            stages: int) -> tuple[str, str] | None:
    """(reason, detail) of a gradient the shard drops unread, or None if it may be decoded. `seal`: None until the
    leader's welcome brought it (then every gradient is a forgery to this shard)."""
    at = where(h)
    if seal is None or not seal.valid(h["lease"], term, h["step"], h["lo"], h["hi"], h["wid"], h["inc"]):
        return "forged_lease", at  # not a lease the leader handed this worker
    if h["step"] != version or h["version"] != version:
        return "stale_step", f"{at}, current step {version}"
    if not reduction.is_subtree(h["lo"], h["hi"], microbatches):
        return "bad_microbatch", at
    g = h["stage"]  # 0 unless pipelined (a bool, which decode drops as bad_field, is no stage here either)
    if type(g) is not int or not 0 <= g < stages:
        return "bad_stage", f"{at}: stage {g} of {stages}"
    return None
