"""What a declaration is made of: an optional field's default (`Default`) or its absence (`ABSENT`), the worker's
envelope every worker message starts with (`Worker`), and the two declarations every message may carry (a `Part` of a
big message, a `Tensor` entry of its `tensors`). The package's docstring (shared/wire/messages/__init__.py) says how
a declaration reads.
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
