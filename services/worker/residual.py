"""The worker's error-feedback state rewound when a step it already encoded is asked of it again (issue 47).

A codec with error feedback per worker (`topk`, `powersgd`, `sign` with `compression.error_feedback`) moves its
residual (and PowerSGD its warm-start Q) with every encoding. A step is asked again when its first asking came to
nothing: the leader died before committing it (a new term, whose step log replays every committed step and asks the
first uncommitted one again), or a shard restarted under the lease. Encoded again from the moved residual, the step
would carry its first encoding's leftovers twice, and a W = 1 run with two leader kills of a 600-step `topk` run
ended with another `params_sha256` than `cmemi reference` (docs/design/step-log.md). So the state before a step's
first encoding is kept, and put back when that step is encoded again in a new term or for a microbatch already
encoded: every step's encoding starts from the state after the previous COMMITTED step, as the reference's does.

Why step-wide, not per microbatch: the residual is the worker's, summed over whatever it encoded (the reference's
one worker encodes a whole step at once); a step asked again threw away every encoding of it the worker made, since
no server keeps a gradient of an uncommitted step across a term. The leader leases step s + 1 only after it committed
s, so a re-asked step is the last one encoded or none (a rewind to a checkpoint without the log: not this rule's,
nothing restorable). A worker's own death is unchanged: its residual dies with it (docs/guides/compression.md,
`cmemi reference --codec-reset`).

Cost: one copy of the state (P floats for topk and sign, P plus the Q factors for powersgd) once per step, only for
a stateful codec; nothing otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from cmemi.shared.compression.base import Codec, GradientCodec


@dataclass
class Encoded:
    """What the worker encoded of its last step: which step, in which term, which microbatch ranges [lo, hi)."""

    step: int
    term: int
    spans: list[tuple[int, int]] = field(default_factory=list)

    def overlaps(self, lo: int, hi: int) -> bool:
        return any(a < hi and lo < b for a, b in self.spans)


class Rewind:
    """Keeps `codec`'s state from before its last step's first encoding; `before_encoding` restores it when needed."""

    def __init__(self, codec: GradientCodec) -> None:
        self.codec = codec
        self.stateful = isinstance(codec, Codec) and codec.stateful  # (the GradientCodec protocol does not declare it)
        self.last: Encoded | None = None
        self.kept: dict[str, torch.Tensor] = {}
        self.rewound = 0  # how many times the state was put back (tests and logs read it)

    def before_encoding(self, term: int, step: int, lo: int, hi: int) -> bool:
        """Called before the codec encodes lease [lo, hi) of `step` asked in `term`; True when the state was put back
        to what it was before this step's first encoding."""
        if not self.stateful:
            return False
        last = self.last
        if last is None or step != last.step:
            # a new step: the last one was committed (the leader leased this one), its encodings stand
            self.kept = {k: t.detach().clone() for k, t in self.codec.state_dict().items()}
            self.last = Encoded(step, term, [(lo, hi)])
            return False
        if term == last.term and not last.overlaps(lo, hi):
            last.spans.append((lo, hi))  # another microbatch of the same step: its encodings add up
            return False
        # asked again (a new term, or the same microbatch again): every encoding of this step came to nothing
        self.codec.load_state_dict(self.kept)  # clones: `kept` stays for a third asking
        self.last = Encoded(step, term, [(lo, hi)])
        self.rewound += 1
        return True
