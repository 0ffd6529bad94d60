"""`cmemi up`'s end: everything it still holds is stopped at once, not one after another.

The coordinator, the embedded redis-server and the zygote (and any service a dead coordinator left behind) are
signalled together and waited for together, under one deadline; a process still running after a moment is
named on the terminal, so a slow exit is never a silent wait.
"""

from __future__ import annotations

import signal
import sys
import time

from cmemi.shared.runtime.lifeline import Stoppable

SAY_AFTER_S = 1.0  # a stop that takes longer than this names what it waits for


def stop_together(procs: dict[str, Stoppable], grace: float = 5.0, say: bool = True) -> None:
    """SIGTERM every process in `procs` (name -> process), wait up to `grace` seconds for all of them, SIGKILL
    whoever is left; returns once all are reaped."""
    live = {name: p for name, p in procs.items() if p.poll() is None}
    for p in live.values():
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    start = time.monotonic()
    said = False
    while live and time.monotonic() - start < grace:
        live = {name: p for name, p in live.items() if p.poll() is None}
        if live and say and not said and time.monotonic() - start >= SAY_AFTER_S:
            print(f"cmemi: waiting for {', '.join(f'{n} (pid {p.pid})' for n, p in live.items())} to exit (at most "
                  f"{grace - SAY_AFTER_S:.0f} s more)", file=sys.stderr, flush=True)
            said = True
        time.sleep(0.01)
    for p in live.values():
        if p.poll() is None:
            p.kill()
        p.wait()
