"""Data off the critical path: microbatches read and collated ahead, in separate loader processes.

`data.workers: N` (N > 0) forks N loader processes from the worker once its dataset is built (before
any ZeroMQ or Redis thread exists). The worker asks for the microbatches of its lease as soon as it
holds the lease (and, once it has sent a gradient, for the same node of the next step, which it
usually gets again), so the next microbatch is read while the current one computes.

Same bits as reading in the worker: the data of microbatch (s, m) is read with torch, numpy and
`random` seeded from the *data* stream of (seed, s, m), in whichever process reads it
(`shared/core/data.py: read_microbatch`); the model's stream (dropout) is seeded separately in the
worker before the forward pass. No thread shares the process-global generators with the compute.

Transport, without pickle: a SOCK_SEQPACKET socket pair per loader carries msgpack headers; the
batch's tensors are written into shared-memory slots (memfd) that the loader creates and passes to
the worker once (SCM_RIGHTS), so a batch crosses as one copy. A batch that is not a structure of
tensors, numbers and strings is read in the worker instead (said once). User code that raises in a
loader comes back as the same one-line failure (`UserCodeError`), so the worker's retry rule holds.
A loader that dies (SIGKILL, OOM) is noticed at once (its socket closes): what it held is read in
the worker, and a fresh loader takes its place. A loader dies with its worker (PR_SET_PDEATHSIG) and
shows as `python -m cmemi loader --worker-pid PID` (not as a worker, to `ps` and chaos scripts).
"""

from __future__ import annotations

import mmap
import os
import select
import signal
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
from cmemi.shared.config.schema import Config
from cmemi.shared.config.usercode import Failure, RemoteFailure, describe
from cmemi.shared.core.data import read_microbatch
from cmemi.shared.errors import Interrupt
from cmemi.shared.runtime import proctitle
from cmemi.shared.runtime.lifeline import die_with_parent

ALIGN = 64
MAX_HEADER = 64 << 10  # under a Unix socket's default send buffer (a SOCK_SEQPACKET message must fit in it)
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)}


class Unsupported(Interrupt):
    """The batch holds something the slot layout cannot carry."""


def _layout(batch: Any, tensors: list[tuple[torch.Tensor, int]], offset: list[int]) -> Any:
    """The batch's structure with each tensor replaced by (dtype, shape, byte offset in the slot); the tensors
    and their offsets are appended to `tensors`, the slot's size so far is offset[0]."""
    if isinstance(batch, torch.Tensor):
        if str(batch.dtype) not in _DTYPES:
            raise Unsupported(f"a tensor of dtype {batch.dtype}")
        t = batch.detach().contiguous()
        at = offset[0]
        tensors.append((t, at))
        offset[0] = at + (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
        return {"t": [str(t.dtype), list(t.shape), at]}
    if type(batch) in (tuple, list):  # (a namedtuple would come back as a plain tuple: read it in the worker)
        return {"tuple" if isinstance(batch, tuple) else "list": [_layout(b, tensors, offset) for b in batch]}
    if type(batch) is dict and all(isinstance(k, str) for k in batch):
        return {"dict": {k: _layout(v, tensors, offset) for k, v in batch.items()}}
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return {"v": batch}
    raise Unsupported(f"a {type(batch).__name__}")


def _rebuild(tree: dict[str, Any], buf: memoryview) -> Any:
    if "t" in tree:
        dtype, shape, at = tree["t"]
        dt = _DTYPES[dtype]
        n = 1
        for s in shape:
            n *= s
        if n == 0:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(buf, dtype=dt, count=n, offset=at).view(shape)
    if "tuple" in tree:
        return tuple(_rebuild(t, buf) for t in tree["tuple"])
    if "list" in tree:
        return [_rebuild(t, buf) for t in tree["list"]]
    if "dict" in tree:
        return {k: _rebuild(v, buf) for k, v in tree["dict"].items()}
    return tree["v"]


def _serve(sock: socket.socket, cfg: Config, dataset: Any, slots: int) -> None:
    """A loader process: read (step, m) into the slot it names, reply with the layout (or the failure)."""
    torch.set_num_threads(cfg.cluster.threads_per_worker)
    n = len(dataset)
    maps: list[mmap.mmap | None] = [None] * slots
    while True:
        try:
            raw = sock.recv(MAX_HEADER)
        except OSError:
            return
        if not raw:  # the worker closed its end
            return
        req = msgpack.unpackb(raw)
        step, m, slot = req["step"], req["m"], req["slot"]
        reply: dict[str, Any] = {"step": step, "m": m, "slot": slot}
        fds: list[int] = []
        try:
            batch = read_microbatch(cfg, dataset, n, step, m)
        except Exception as exc:  # user code: the worker raises it as the same one-line failure
            f = describe(exc)
            reply["error"] = [f.kind, f.text, f.function, f.location]
        else:
            try:
                tensors: list[tuple[torch.Tensor, int]] = []
                offset = [0]
                reply["tree"] = _layout(batch, tensors, offset)
                size = max(offset[0], ALIGN)
                cur = maps[slot]
                if cur is None or len(cur) < size:
                    size = max(size, 2 * len(cur) if cur is not None else size)
                    fd = os.memfd_create(f"cmemi-batch-{slot}", os.MFD_CLOEXEC)
                    os.ftruncate(fd, size)
                    cur = maps[slot] = mmap.mmap(fd, size)
                    fds.append(fd)
                    reply["size"] = size
                view = memoryview(cur)
                for t, at in tensors:
                    if t.numel():
                        raw_bytes = t.reshape(-1).view(torch.uint8).numpy()
                        view[at:at + raw_bytes.nbytes] = raw_bytes.data
                view.release()
            except Unsupported as exc:
                reply.pop("tree", None)
                reply["unsupported"] = str(exc)
        packed = msgpack.packb(reply)
        if len(packed) > MAX_HEADER:  # (long strings in the batch): the worker reads this one itself
            packed = msgpack.packb({"step": step, "m": m, "slot": slot, "unsupported": "a batch header over 64 KiB",
                                    **({"size": reply["size"]} if fds else {})})
        try:
            socket.send_fds(sock, [packed], fds) if fds else sock.send(packed)
        except OSError:
            return
        for fd in fds:
            os.close(fd)


@dataclass
class _Proc:
    pid: int
    sock: socket.socket
    maps: list[mmap.mmap | None]
    free: deque[int]
    inflight: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (step, m)


class Loader:
    """Reads microbatches ahead in `workers` forked processes.

    `want(step, ms)` names what the worker needs now (anything else asked for earlier is dropped),
    `guess(step, ms)` what it will probably need next, `get(step, m)` waits for one batch."""

    def __init__(self, cfg: Config, dataset: Any, workers: int, slots: int = 4, log: Any = None) -> None:
        self.cfg, self.dataset, self.log = cfg, dataset, log
        self.slots = slots
        self.procs: list[_Proc | None] = [self._fork() for _ in range(workers)]
        self.wanted: list[tuple[int, int]] = []  # in the order they are needed
        self.queue: deque[tuple[int, int]] = deque()  # wanted, not sent to a loader yet (no free slot)
        self.ready: dict[tuple[int, int], tuple[_Proc, int, dict[str, Any]]] = {}  # (step, m) -> (proc, slot, reply)
        self.deaths = 0
        self.unsupported: str | None = None

    def _fork(self) -> _Proc:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the loader: serve until the worker goes, never return into the worker's code
            code = 0
            try:
                parent_end.close()
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(s, signal.SIG_DFL)
                die_with_parent(parent)
                proctitle.set_cmdline([sys.executable, "-m", "cmemi", "loader", "--worker-pid", str(parent)])
                _serve(child_end, self.cfg, self.dataset, self.slots)
            except BaseException:  # noqa: BLE001 - a loader's own failure shows as its death in the worker
                code = 1
            finally:
                os._exit(code)
        child_end.close()
        return _Proc(pid, parent_end, [None] * self.slots, deque(range(self.slots)))

    # ------------------------------------------------------------------ asking ahead
    def want(self, step: int, ms: range | list[int]) -> None:
        """The microbatches the worker needs now, in order; batches read for anything else are dropped."""
        keys = [(step, m) for m in ms]
        self.wanted = keys
        for key in [k for k in self.ready if k not in keys]:
            p, slot, _ = self.ready.pop(key)
            self._free(p, slot)
        self.queue = deque(k for k in keys if not self._asked(k))
        self._dispatch()

    def guess(self, step: int, ms: range | list[int]) -> None:
        """Microbatches the worker will probably need after the wanted ones: read them when a slot is free."""
        for key in ((step, m) for m in ms):
            if key not in self.wanted:
                self.wanted.append(key)
                if not self._asked(key):
                    self.queue.append(key)
        self._dispatch()

    def _asked(self, key: tuple[int, int]) -> bool:
        return key in self.ready or any(p is not None and key in p.inflight.values() for p in self.procs)

    def _dispatch(self) -> None:
        while self.queue:
            live = [p for p in self.procs if p is not None and p.free]
            if not live:
                return
            p = max(live, key=lambda q: len(q.free))
            key = self.queue.popleft()
            slot = p.free.popleft()
            try:
                p.sock.send(msgpack.packb({"step": key[0], "m": key[1], "slot": slot}))
            except OSError:
                p.free.appendleft(slot)
                self.queue.appendleft(key)
                self._died(self.procs.index(p))
                continue
            p.inflight[slot] = key

    def _free(self, p: _Proc, slot: int) -> None:
        """Slot `slot` of loader `p` may be written again (unless `p` died meanwhile: its slots went with it)."""
        if any(q is p for q in self.procs):
            p.free.append(slot)
            self._dispatch()

    # ------------------------------------------------------------------ taking
    def get(self, step: int, m: int, timeout: float = 3600.0) -> tuple[Any, Any] | None:
        """The batch of (step, m) and the function to call once it is no longer in use; None: read it in the
        worker (a loader died holding it, no loader is left, or the batch cannot travel). Raises RemoteFailure
        when user code raised in the loader."""
        key = (step, m)
        if key not in self.wanted:
            self.guess(step, [m])
        deadline = time.monotonic() + timeout
        while key not in self.ready:
            if not self._asked(key) and key not in self.queue:  # lost with a dead loader
                return None
            if not any(p is not None for p in self.procs):
                return None
            if key in self.queue and not any(p is not None and (p.free or p.inflight) for p in self.procs):
                self.queue.remove(key)  # every slot holds a batch not yet released: read this one here
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"data loaders gave no batch for microbatch {m} of step {step} in {timeout:.0f}s")
            self._receive(deadline - time.monotonic())
        p, slot, reply = self.ready.pop(key)
        self.wanted = [k for k in self.wanted if k != key]
        if "tree" not in reply:
            self._free(p, slot)
            if "error" in reply:
                raise RemoteFailure(Failure(*reply["error"]))
            if self.unsupported is None and self.log is not None:
                self.log.warning("batches are read in the worker: data.workers carries tensors, numbers and strings "
                                 "only", found=reply["unsupported"])
            self.unsupported = reply["unsupported"]
            return None
        assert p.maps[slot] is not None
        batch = _rebuild(reply["tree"], memoryview(p.maps[slot]))  # type: ignore[arg-type]
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._free(p, slot)
        return batch, release

    def _receive(self, timeout: float) -> None:
        socks = {p.sock.fileno(): i for i, p in enumerate(self.procs) if p is not None and p.inflight}
        if not socks:
            return
        readable, _, _ = select.select(list(socks), [], [], max(0.0, min(timeout, 1.0)))
        for fd in readable:
            i = socks[fd]
            p = self.procs[i]
            assert p is not None
            try:
                raw, fds, _, _ = socket.recv_fds(p.sock, MAX_HEADER, 1)
            except OSError:
                raw, fds = b"", []
            if not raw:
                self._died(i)
                continue
            reply = msgpack.unpackb(raw)
            slot = reply["slot"]
            if fds:
                p.maps[slot] = mmap.mmap(fds[0], reply["size"])
                os.close(fds[0])
            key = p.inflight.pop(slot)
            if key in self.wanted:
                self.ready[key] = (p, slot, reply)
            else:
                self._free(p, slot)

    def _died(self, i: int) -> None:
        """Loader i is gone: what it held is read in the worker; a fresh loader takes its place."""
        p = self.procs[i]
        if p is None:
            return
        p.sock.close()
        try:
            _, status = os.waitpid(p.pid, 0)
            how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        except ChildProcessError:
            how = "unknown"
        for key in [k for k, (q, _, _) in self.ready.items() if q is p]:
            del self.ready[key]
        lost = set(p.inflight.values())
        self.wanted = [k for k in self.wanted if k not in lost]  # get() reads these in the worker
        self.deaths += 1
        if self.log is not None:
            self.log.warning("data loader died; its microbatches are read in the worker and a new loader starts",
                             pid=p.pid, how=how, deaths=self.deaths)
        self.procs[i] = None
        if self.deaths <= 10 * len(self.procs):  # a loader that keeps dying is not replaced forever
            self.procs[i] = self._fork()
            self._dispatch()  # what waited for a slot goes to the new loader

    def close(self) -> None:
        for p in self.procs:
            if p is not None:
                p.sock.close()
                try:
                    os.kill(p.pid, signal.SIGKILL)
                    os.waitpid(p.pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
        self.procs = []
