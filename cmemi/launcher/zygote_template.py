"""A warm zygote for many runs: one process imports what a zygote imports, once, then forks a zygote for each
`cmemi up` that asks, already past its imports (`CMEMI_ZYGOTE_TEMPLATE=SOCKET` in `cmemi up`'s environment).

Why: a zygote's imports (torch, torch._dynamo, the services: cmemi/launcher/zygote.py PRELOAD) are ~4 s of every
`cmemi up`'s start on a 2-core machine, before any service can be forked. A test suite or a sweep that starts
hundreds of short runs pays that hundreds of times; a template pays it once. `python -m cmemi zygote-template SOCKET`
starts one (tests/conftest.py does, for the session); `cmemi up` uses it when the variable names it and falls back
to a zygote of its own whenever it cannot (cmemi/launcher/zygote_up.py).

A forked zygote must be what `cmemi up` would have started: the request brings `cmemi up`'s stdin, stdout and
stderr (SCM_RIGHTS), its environment, working directory and umask; the child takes them, joins `cmemi up`'s process
group, starts sys.path at the working directory as `python -m` does, and watches a pidfd of `cmemi up` instead of
PR_SET_PDEATHSIG (its parent is the template). What a fork cannot change is refused (`admit`), and that `cmemi up`
starts its own: another namespace, cgroup, session, CPU set, niceness or resource limits, or interpreter-start
variables (PYTHONPATH, LD_PRELOAD, OMP_NUM_THREADS, ...) that differ from the template's. Same owner only (0600
socket, SO_PEERCRED), as for the zygote; the template is a child subreaper, so a zygote's orphans are reaped.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import random
import select
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

from cmemi.launcher import zygote
from cmemi.launcher.launch import exit_code, huge_pages_env, user_code_importable
from cmemi.launcher.supervise import become_subreaper
from cmemi.shared.runtime import atomic, proctitle
from cmemi.shared.runtime.exits import exit_now

# what the interpreter, the loader, malloc and torch read as they start (thread counts included); not every variable
# of those libraries: a library sets some in os.environ at import (scikit-learn: KMP_DUPLICATE_LIB_OK), which a test
# process then passes to every later `cmemi up`, and none of those changes what the template's imports did
START_PREFIXES = ("PYTHON", "LD_", "GLIBC_", "MALLOC_", "TORCH", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
                  "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
NAMESPACES = ("net", "mnt", "pid", "user", "ipc", "uts", "cgroup")
STARTED_ENV: dict[str, str] = {}  # this process's environment as it started


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: whoever started us stops us
    sock_path = argv[0]
    STARTED_ENV.update(os.environ)  # before any import sets a variable of its own (torch sets some)
    proctitle.set_cmdline([sys.executable, "-m", "cmemi", "zygote-template"])
    started_in = sys.path[0] if sys.path else ""
    for name in (*zygote.PRELOAD, "cmemi.commands.reference"):
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    become_subreaper()
    exits = Path(sock_path).parent / "exits"
    exits.mkdir(parents=True, exist_ok=True)
    server = zygote.Server(sock_path, exits, roles=("zygote", "reference"), fds=3, admit=admit)
    atomic.write_text(Path(sock_path).parent / "ready.json", json.dumps({"pid": os.getpid()}))
    request = server.serve()  # returns in a forked child only
    lifeline = _become(request, started_in)
    if lifeline is None:
        return 0  # the asker is gone already
    if request["argv"][3] == "reference":
        _reference(request["argv"], lifeline)
    return zygote.main([], lifeline=lifeline)


def admit(request: dict[str, Any]) -> str | None:
    """None when a zygote forked here for the asker is what the asker would have started; else why not."""
    peer = request["peer"]
    try:
        for ns in NAMESPACES:
            if os.stat(f"/proc/{peer}/ns/{ns}").st_ino != os.stat(f"/proc/self/ns/{ns}").st_ino:
                return f"another {ns} namespace"
        for what in ("cgroup", "limits"):
            if Path(f"/proc/{peer}/{what}").read_text() != Path(f"/proc/self/{what}").read_text():
                return f"another {what}"
        if os.sched_getaffinity(peer) != os.sched_getaffinity(0):
            return "another CPU set"
        if os.getpriority(os.PRIO_PROCESS, peer) != os.getpriority(os.PRIO_PROCESS, 0):
            return "another niceness"
        if os.getsid(peer) != os.getsid(0):
            return "another session (its process group cannot be joined)"
    except OSError as exc:
        return f"the asker could not be read ({exc})"
    env = huge_pages_env(request["env"]) or request["env"]  # what the zygote would re-exec itself with
    # a variable our imports set (torch: TORCHINDUCTOR_CACHE_DIR) a fresh zygote's would set alike, unless given one
    by_imports = {k: v for k, v in os.environ.items() if k not in STARTED_ENV}
    differ = sorted(k for k in {*env, *STARTED_ENV} if k.startswith(START_PREFIXES) and env.get(k) != STARTED_ENV.get(k)
                    and not (k in by_imports and env.get(k) in (None, by_imports[k])))
    if differ:
        return f"interpreter-start variables differ: {', '.join(differ)}"
    return None


def _reference(argv: list[str], lifeline: int) -> NoReturn:
    """In the forked child: `cmemi reference ARGS` as a fresh interpreter runs it (its imports done), with the asker's
    standard streams; its exit code is the template's record of ours. A test suite runs ~40 of them, each a torch
    import otherwise. Dies with the asker (a timeout that kills it leaves no reference running)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    proctitle.set_cmdline(argv)
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):  # buffered as a fresh interpreter's on these streams
        stream.reconfigure(line_buffering=os.isatty(fd) or fd == 2)  # type: ignore[union-attr]
    random.seed()  # a fresh interpreter's generator differs per process; a forked copy would not
    threading.Thread(target=_die_with, args=(lifeline,), name="lifeline", daemon=True).start()
    user_code_importable()
    from cmemi.commands.reference import main as reference_main

    exit_now(exit_code(lambda: reference_main(argv[4:])))


def _die_with(pidfd: int) -> None:
    select.select([pidfd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _become(request: dict[str, Any], started_in: str) -> int | None:
    """In the forked child: take the asker's descriptors, group, directory and environment. Returns a pidfd of the
    asker (the lifeline), or None when it is gone."""
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    try:
        lifeline = os.pidfd_open(request["peer"])
    except OSError:
        return None
    try:
        os.setpgid(0, os.getpgid(request["peer"]))
    except OSError:
        pass  # it left its group in the meantime: ours is as good
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    if request["umask"] is not None:
        os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    if sys.path and sys.path[0] == started_in:
        sys.path[0] = os.getcwd()  # `python -m` starts sys.path at the working directory: the asker's
    # user code the zygote imports reads sys.argv as a fresh zygote's (`ps`' title: zygote.main sets it)
    sys.argv = [sys.argv[0], *request["argv"][3:]]
    return lifeline
