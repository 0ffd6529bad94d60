"""Asking `cmemi up`'s zygote for a process, and reading back how it ended.

The zygote (cmemi/launcher/zygote.py) is a process that has imported torch and the services once; it forks a
service in milliseconds instead of the seconds a fresh interpreter spends importing. It exists only
under `cmemi up`, which names it in the environment (socket path and pid). `spawn` returns None
whenever the zygote cannot serve (none, dead, not answering): the caller then starts the process as
before, so the zygote is never a single point of failure.

Its children are not the caller's children: the zygote reaps them and writes each exit code to
RUN_DIR/zygote/exits/PID (atomically), which `exit_code` reads. Linux only, like the pidfds it sends.
Standard library only: the coordinator, which imports this, never imports torch.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOCKET_ENV = "CMEMI_ZYGOTE_SOCKET"  # the zygote's Unix socket (RUN_DIR/zygote/socket)
PID_ENV = "CMEMI_ZYGOTE_PID"
READY_S = 120.0  # a zygote still importing (or checking the config) is waited for this long: Popen is no faster
ANSWER_S = 5.0  # a zygote that accepted a request answers within this, or it is not used again
TEMPLATE_ANSWER_S = 30.0  # a template answers within this (it forks only: a fallback costs a zygote's imports)
RECORD_WAIT_S = 2.0  # after a child's exit, its exit code is on disk within this while the zygote lives
MAX_MESSAGE = 1 << 20  # a request or reply longer than this is refused
ZYGOTE_SERVICES = ("aggregator", "worker", "checkpointer")  # what a zygote forks (the coordinator: `cmemi up`)

_given_up = False  # the zygote failed to answer once: this process starts everything with Popen from now on


@dataclass
class Spawned:
    pid: int
    pidfd: int | None  # the zygote's pidfd of the child, passed over the socket (no pid-reuse race)
    exit_record: str  # where the zygote writes the child's exit code


def zygote_dir(run_dir: Path) -> Path:
    return run_dir / "zygote"


def record_path(exits_dir: str | Path, pid: int) -> str:
    return str(Path(exits_dir) / str(pid))


def validate(req: Any, roles: tuple[str, ...] = ZYGOTE_SERVICES) -> dict[str, Any]:
    """A request: {"argv": ["python", "-m", "cmemi", ROLE, ...], "env": {str: str}, "cwd": str}, ROLE one of
    `roles`; optionally "umask" (an int), which the child takes."""
    if not isinstance(req, dict):
        raise ValueError("request is not an object")
    argv, env, cwd = req.get("argv"), req.get("env"), req.get("cwd")
    if not (isinstance(argv, list) and len(argv) >= 4 and all(isinstance(a, str) and "\0" not in a for a in argv)):
        raise ValueError("argv is not a list of strings")
    if argv[1:3] != ["-m", "cmemi"] or argv[3] not in roles:
        raise ValueError(f"argv is not `python -m cmemi {'|'.join(roles)} ...`")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) and "\0" not in k + v
                                          and "=" not in k and k for k, v in env.items())):
        raise ValueError("env is not a map of strings")
    if not isinstance(cwd, str) or "\0" in cwd:
        raise ValueError("cwd is not a string")
    umask = req.get("umask", None)
    if umask is not None and not (type(umask) is int and 0 <= umask <= 0o777):
        raise ValueError("umask is not a mode")
    return {"argv": argv, "env": env, "cwd": cwd, "umask": umask}


def connect_path(path: str) -> tuple[str, int]:
    """A Unix socket path may be 108 bytes at most; a run directory may be longer. Going through an O_PATH
    descriptor of the directory keeps every socket path short. Returns (path to use, fd to close after)."""
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}", fd


def running(pid: int) -> bool:
    """Running (not exited, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def available() -> bool:
    return not _given_up and bool(os.environ.get(SOCKET_ENV)) and os.environ.get(PID_ENV, "").isdigit()


def spawn(argv: list[str], env: dict[str, str], cwd: str | None = None) -> Spawned | None:
    """Ask the zygote to fork `argv` (a `python -m cmemi ROLE ...` command line) with `env`; None when it cannot."""
    global _given_up
    if not available():
        return None
    path, zpid = os.environ[SOCKET_ENV], int(os.environ[PID_ENV])
    request = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd()}).encode() + b"\n"
    deadline = time.monotonic() + READY_S
    while True:
        if not running(zpid):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(ANSWER_S)
        try:
            short, fd = connect_path(path)
        except OSError:  # the run directory went away
            sock.close()
            return None
        try:
            sock.connect(short)
            break
        except (FileNotFoundError, ConnectionRefusedError):  # not listening yet: importing or checking the config
            sock.close()
            if time.monotonic() > deadline:
                _given_up = True
                return None
            time.sleep(0.05)
        except OSError:
            sock.close()
            return None
        finally:
            os.close(fd)
    try:
        with sock:
            sock.sendall(request)
            reply, fds = _receive(sock)
    except (OSError, ValueError):  # timed out, reset, or not our reply format: stop asking this zygote
        _given_up = True
        return None
    pid = reply.get("pid") if isinstance(reply, dict) else None
    if not isinstance(reply, dict) or not isinstance(pid, int) or not isinstance(reply.get("exits"), str):
        for fd in fds:
            os.close(fd)
        return None  # refused (e.g. the command line does not fit its title): Popen this one
    return Spawned(pid, fds[0] if fds else None, record_path(reply["exits"], pid))


def ask(path: str, request: dict[str, object], fds: list[int]) -> tuple[int, int, str, int] | str:
    """One request to a zygote template (cmemi/launcher/zygote_template.py) listening at `path`, sending `fds`:
    (pid, pidfd, exit record, the template's pid) of what it forked; else why not (it is not there, did not answer
    within TEMPLATE_ANSWER_S, or refused): the caller then starts its own."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TEMPLATE_ANSWER_S)
    try:
        short, fd = connect_path(path)
    except OSError as exc:
        sock.close()
        return f"no template at {path} ({exc.strerror or exc})"
    try:
        with sock:
            sock.connect(short)
            server = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], fds)
            reply, got = _receive(sock)
    except (OSError, ValueError) as exc:
        return f"the template at {path} did not answer ({exc})"
    finally:
        os.close(fd)
    pid = reply.get("pid") if isinstance(reply, dict) else None
    if not (isinstance(reply, dict) and isinstance(pid, int) and isinstance(reply.get("exits"), str) and len(got) == 1):
        for extra in got:
            os.close(extra)
        error = reply.get("error") if isinstance(reply, dict) else None
        return f"refused: {error}" if isinstance(error, str) else "its answer named no process"
    return pid, got[0], record_path(reply["exits"], pid), server


def _receive(sock: socket.socket) -> tuple[object, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _flags, _addr = socket.recv_fds(sock, 65536, 1)
        fds += got
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_MESSAGE:
            raise ValueError("reply too long")
    return json.loads(data), fds


def exit_code(record: str, zygote_pid: int | None = None) -> int | None:
    """The exit code the zygote recorded for a child that has exited (negative: killed by that signal);
    None when there is none (the zygote died before reaping it). Waits up to RECORD_WAIT_S for a record
    still being written, while the zygote runs. The record is deleted once read."""
    if zygote_pid is None:
        zygote_pid = int(os.environ[PID_ENV]) if os.environ.get(PID_ENV, "").isdigit() else None
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        try:
            rc = int(Path(record).read_text())
        except (OSError, ValueError):
            if zygote_pid is None or not running(zygote_pid) or time.monotonic() > deadline:
                return None
            time.sleep(0.005)
            continue
        Path(record).unlink(missing_ok=True)
        return rc
