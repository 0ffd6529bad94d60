"""Starting one service in this process, as `python -m cmemi ROLE ...` does: from the command line
(`cmemi/cli.py`) or in a child the zygote forked (`cmemi/launcher/zygote.py`). Below both, so neither imports the other.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

SERVICES = ("aggregator", "worker", "checkpointer", "coordinator")
HUGE_PAGES = "glibc.malloc.hugetlb=1"


def user_code_importable() -> None:
    """The user's packages (`mypkg.models:make_net`) import from the current directory, as under `python -m
    cmemi` (how services start): an installed `cmemi` script's sys.path starts at its bin directory instead."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def run_service(role: str, argv: list[str]) -> None:
    """Import the service `role` (one of SERVICES) and run its main with `argv`."""
    from cmemi.shared.runtime import startup

    service = importlib.import_module(f"cmemi.services.{role}.__main__")
    startup.mark("imported")
    service.main(argv)


def exit_code(fn: Callable[[], int | None]) -> int:
    """Run `fn` as `sys.exit(fn())` would, and return the exit code instead of exiting (a message given to
    SystemExit is printed, code 1). An exception other than SystemExit propagates (its traceback as usual)."""
    try:
        code: str | int | None = fn()
    except SystemExit as exc:
        code = exc.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        return 1
    return int(code or 0)


def huge_pages_env(env: dict[str, str]) -> dict[str, str] | None:
    """The environment a service started with `env` re-execs itself with (cmemi/cli.py `_with_huge_pages`); None: no re-exec."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if (sys.platform != "linux" or "glibc.malloc.hugetlb" in tunables or env.get("CMEMI_HUGE_PAGES") == "0"
            or not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")):
        return None
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}
