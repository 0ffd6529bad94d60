"""One error tree: every exception CMEMI raises on purpose derives from `CmemiError`, under one of four branches
that say what the catcher does with it. Each class also keeps the builtin it always was (`ValueError`,
`RuntimeError`), so the standard library's callers (argparse, a `float()` guard) still see what they expect.

- `UserError`: the user's config, code, data or environment is wrong. One line names the field or the function
  and the fix; the process exits `Exit.FATAL` (2) and is not restarted (`shared/runtime/exits.py`).
- `WireError`: a message, a slot or a file does not decode or does not fit. The receiver drops it and counts it
  by reason; it never crashes a service.
- `FaultError`: something outside the user's config failed (a device, the checkpoint store, an evaluation): the
  service says so and, where it cannot go on, exits to be restarted.
- `Interrupt`: control flow between the modules of one service (stale parameters, a lost shard link, a term to
  rejoin). It is caught inside the service that raised it and never reaches a user.
"""

from __future__ import annotations


class CmemiError(Exception):
    """The root of every error CMEMI raises on purpose."""


class UserError(CmemiError):
    """The user's config, code, data or environment is wrong: exit 2 with one line naming the fix."""


class WireError(CmemiError):
    """A message, slot or file that does not decode or fit: dropped and counted, never a crash."""


class FaultError(CmemiError):
    """A failure outside the user's config (device, store, evaluation): reported, then restarted or skipped."""


class Interrupt(CmemiError):
    """Control flow inside one service; never escapes it."""
