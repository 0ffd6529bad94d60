"""The zygote: one process that imports torch and the services once, then forks each service on request.

Started by `cmemi up` before anything else (`python -m cmemi zygote <room>`), so its imports overlap
with `cmemi up`'s own start. Then:
1. it imports what every service needs (PRELOAD) and never runs a torch op: a fork after an OpenMP or
   intra-op thread pool exists is unsafe, and none exists until the first parallel op;
2. it reads one line from `cmemi up` on stdin: the run's config and where to listen;
3. it imports the modules the config names (cmemi/launcher/zygote_user_code.py; not under cluster.zygote_imports: false),
   so that no service imports them again, then builds the training dataset once, as a worker would, for the workers
   to share (cmemi/launcher/zygote_data.py; not under cluster.zygote_data: false; a raising one is the run's one line);
4. meanwhile it checks the config's functions (shared/config/plugins.py check_plugins) in a forked child, so a bad
   config fails in one line before any service starts; the verdict goes to RUN_DIR/zygote/ready.json
   (after a failed check it never listens, and waits for `cmemi up` to stop it);
5. it listens on RUN_DIR/zygote/socket (mode 0600, and only its own user's requests are served) and
   forks `python -m cmemi ROLE ...` for whoever asks (the coordinator, shared/runtime/zygote.py): the child takes
   the request's environment and working directory, shows the request's command line in
   /proc/PID/cmdline (shared/runtime/proctitle.py), resets signals and runs `cmemi.cli.main` as a fresh process
   would. The reply carries its pid and a pidfd. The zygote reaps its children and writes each exit
   code to RUN_DIR/zygote/exits/PID.
A malformed request is dropped, counted and logged on stderr; it never stops the zygote. The zygote
dies with `cmemi up` (PR_SET_PDEATHSIG); its children do not die with it (they hold their own lifeline
to `cmemi up`), so killing it costs later starts their speed, nothing else.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cmemi.launcher import zygote_check, zygote_data
from cmemi.launcher import zygote_user_code as user_code
from cmemi.shared.runtime import atomic, prebuilt, proctitle
from cmemi.shared.runtime.exits import exit_now
from cmemi.shared.runtime.zygote import MAX_MESSAGE, ZYGOTE_SERVICES, connect_path, validate

PRELOAD = ("torch", "torch._dynamo",  # torch.optim's first optimizer imports torch._dynamo: ~2 s on its own
           "numpy", "zmq", "redis", "structlog", "safetensors.torch", "cmemi.shared.config.plugins",
           "cmemi.services.aggregator.__main__", "cmemi.services.worker.__main__",
           "cmemi.services.checkpointer.__main__")
REQUEST_S = 2.0  # a connected client sends its whole request within this, or is dropped


def main(argv: list[str], lifeline: int | None = None) -> int:
    """`lifeline`: a pidfd of `cmemi up`, for a zygote forked by a template (cmemi/launcher/zygote_template.py),
    whose parent is not `cmemi up` (a Popen'd one dies with its parent: PR_SET_PDEATHSIG)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: `cmemi up` stops us
    proctitle.set_cmdline([sys.executable, "-m", "cmemi", "zygote"])  # without the padding `cmemi up` gave it
    phases = {"spawned": _spawned_at()}
    for name in PRELOAD:
        importlib.import_module(name)
    phases["imported"] = time.time()
    line = sys.stdin.readline()  # from `cmemi up`, once it has written the run's config
    try:
        order = json.loads(line)
        config, sock_path = str(order["config"]), str(order["socket"])
    except (ValueError, KeyError, TypeError):
        return 0  # `cmemi up` ended before it had a run (a bad config, --help): nothing to serve
    _stdin_to_devnull()
    zdir = Path(sock_path).parent
    exits = zdir / "exits"
    exits.mkdir(parents=True, exist_ok=True)
    if not user_code.preload(config):
        return 0  # its imports made forking unsafe: every service starts fresh, `cmemi up` checks the config
    phases["user_code_imported"] = time.time()
    gc.collect()
    gc.freeze()  # children never scan (so never copy) the pages of what is imported now
    check = zygote_check.Check(config)  # on the other core while the data is built
    data = zygote_data.build(config)
    built = time.time() if data.shared else None  # beside the phases (their names are the timeline's)
    gc.collect()
    gc.freeze()  # nor those of what was built
    rc, error = check.verdict()
    if data.unsafe:
        return 0  # a factory opened the GPU: every service starts fresh, `cmemi up` checks the config
    if rc == 0 and data.error:
        rc, error = 2, data.error
    phases["plugins_checked"] = time.time()
    if rc != 0:
        atomic.write_text(zdir / "ready.json", json.dumps({"rc": rc, "error": error, "phases": phases}))
        while True:  # never listen: the coordinator waits instead of starting services; `cmemi up` stops us
            if lifeline is None:
                signal.pause()
            elif select.select([lifeline], [], [])[0]:
                return 0
    server = Server(sock_path, exits, lifeline=lifeline)
    phases["listening"] = time.time()
    atomic.write_text(zdir / "ready.json", json.dumps({"rc": 0, "pid": os.getpid(), "phases": phases, "data_built": built,
                                                       "cpu_s": round(time.process_time(), 3)}))  # load-proof
    request = server.serve()  # returns in a forked child only
    _become(request)
    from cmemi.launcher.launch import exit_code, run_service, user_code_importable

    user_code_importable()
    # without the interpreter's teardown (0.5-0.8 s with torch imported, paid by every service at a run's end and
    # before a restart), as a service started from the command line leaves: exit_now runs what at_exit registered
    exit_now(exit_code(lambda: run_service(request["argv"][3], request["argv"][4:])))


def _spawned_at() -> float:
    from cmemi.shared.runtime.startup import spawned_at

    return spawned_at() or time.time()


def _stdin_to_devnull() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)


class Server:
    """Forks on request: the run's services (the zygote), or zygotes themselves (cmemi/launcher/zygote_template.py:
    `roles`, the descriptors a request must bring (`fds`), and `admit`, which refuses a request it cannot serve
    faithfully). With a `lifeline` (a pidfd of `cmemi up`), it stops serving once that process is gone."""

    def __init__(self, path: str, exits: Path, roles: tuple[str, ...] = ZYGOTE_SERVICES, fds: int = 0,
                 admit: Callable[[dict[str, Any]], str | None] | None = None, lifeline: int | None = None) -> None:
        self.exits = exits
        self.roles, self.fds, self.admit, self.lifeline = roles, fds, admit, lifeline
        self.dropped = 0
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd is what matters
        Path(path).unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        short, fd = connect_path(path)
        old = os.umask(0o177)  # the socket is created 0600: only the run's owner may connect
        try:
            self.sock.bind(short)
        finally:
            os.umask(old)
            os.close(fd)
        self.sock.listen(64)
        self.sock.setblocking(False)

    def serve(self) -> dict[str, Any]:
        """Answer requests until one forks: returns that request, in the child."""
        while True:
            watched: list[socket.socket | int] = [self.sock, self.wake_r]
            if self.lifeline is not None:
                watched.append(self.lifeline)
            ready = select.select(watched, [], [])[0]
            if self.lifeline in ready:
                raise SystemExit(0)  # `cmemi up` is gone: nobody is left to ask (its services hold their own lifeline)
            if self.wake_r in ready:
                while True:
                    try:
                        if not os.read(self.wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                self.reap()
            if self.sock in ready:
                try:
                    conn, _ = self.sock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                request = self.handle(conn)
                if request is not None:
                    return request

    def handle(self, conn: socket.socket) -> dict[str, Any] | None:
        with conn:
            try:
                request = self.read(conn)
            except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
                self.drop(str(exc) or type(exc).__name__)
                return None
            received = list(request["fds"])
            try:
                return self.fork(conn, request)
            finally:
                for fd in received:
                    os.close(fd)  # a forked child took its own copies first

    def fork(self, conn: socket.socket, request: dict[str, Any]) -> dict[str, Any] | None:
        """Fork for `request`: returns it in the child; None in the zygote (the asker has the pid and a pidfd)."""
        if len(proctitle.encoded(request["argv"])) > proctitle.room():
            _reply(conn, {"error": "command line longer than the zygote's (shared/runtime/proctitle.py ROOM)"})
            return None
        refused = self.admit(request) if self.admit is not None else None
        if refused is not None:
            _reply(conn, {"error": refused})
            return None
        try:
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: the asker starts it without us
            _reply(conn, {"error": f"fork failed: {exc}"})
            return None
        if pid == 0:
            self.close()
            request["fds"] = [os.dup(fd) for fd in request["fds"]]
            return request
        (self.exits / str(pid)).unlink(missing_ok=True)  # an earlier run's record for a reused pid
        pidfd = None
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pass
        if not _reply(conn, {"pid": pid, "exits": str(self.exits)}, [pidfd] if pidfd is not None else []):
            os.kill(pid, signal.SIGKILL)  # nobody knows of it: the asker starts its own (no duplicate service)
        if pidfd is not None:
            os.close(pidfd)
        return None

    def read(self, conn: socket.socket) -> dict[str, Any]:
        """The request, with "peer" (the asker's pid) and "fds" (the descriptors it sent: exactly `self.fds`)."""
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            raise ValueError(f"request from uid {uid}, not this run's owner")
        conn.setblocking(True)
        conn.settimeout(REQUEST_S)
        data, fds = b"", []
        try:
            while not data.endswith(b"\n"):
                chunk, got, _flags, _addr = socket.recv_fds(conn, 65536, max(self.fds, 1))
                fds += got
                if not chunk:
                    raise ValueError("connection closed before a whole request")
                data += chunk
                if len(data) > MAX_MESSAGE:
                    raise ValueError(f"request longer than {MAX_MESSAGE} bytes")
            if len(fds) != self.fds:
                raise ValueError(f"request brought {len(fds)} descriptors, not {self.fds}")
            request = validate(json.loads(data), self.roles)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return {**request, "peer": pid, "fds": fds}

    def drop(self, why: str) -> None:
        self.dropped += 1
        print(f"cmemi zygote: dropped a request ({why}); {self.dropped} dropped so far", file=sys.stderr, flush=True)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            try:
                atomic.write_text(self.exits / str(pid), json.dumps(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass  # the run directory is gone: nobody is left to read it

    def close(self) -> None:
        """In a forked child: drop everything that is the zygote's."""
        signal.set_wakeup_fd(-1)
        self.sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        if self.lifeline is not None:
            os.close(self.lifeline)


def _reply(conn: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> bool:
    try:
        socket.send_fds(conn, [json.dumps(obj).encode() + b"\n"], fds or [])
        return True
    except OSError:
        return False  # the asker is gone (it gave up waiting)


def _become(request: dict[str, Any]) -> None:
    """In the forked child: look and start like `request["argv"]` run by a fresh interpreter."""
    user_code.after_fork()
    if request["argv"][3] != "worker":
        prebuilt.drop()  # the dataset is the workers': freed here, not held for the run (cluster.zygote_data)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    proctitle.set_cmdline(request["argv"])
    sys.argv = [sys.argv[0], *request["argv"][3:]]
    random.seed()  # a fresh interpreter's generators differ per process; forked copies would not
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
