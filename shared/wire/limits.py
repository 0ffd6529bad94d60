"""Message size limits: the cap on one ZeroMQ message, and the bound on one logical message.

`cluster.max_message_bytes` caps every ZeroMQ message (and, as MAXMSGSIZE, every frame: a bigger
frame disconnects the peer). A logical message bigger than the cap travels in parts under it
(shared/wire/transfer.py), so the cap bounds memory per message, not model size. Its default
(`null`) is the model's logical bound, capped at DEFAULT_CAP: small models send everything in one
message as before, big ones in parts of at most 64 MiB.

The logical bound (`logical_bytes`) is what a receiver accepts for one reassembled message. The
largest honest one is the aggregator's snapshot to the checkpointer: parameters, optimizer state
(Adam keeps two more copies) and buffers; gradients, even with the index tensors of sparse codecs,
and parameters are smaller. So: 4 x (parameter + buffer bytes) + 16 MiB for headers and small
tensors, and never less than the cap; with local steps (train.local_steps) 3 x (parameter + buffer bytes) more per
replica, for the inner states the leader's snapshot holds.

The sizes come from the model the process really builds (`record`, called by plugins.build_model), in
the context a plain script gives the factory: never a meta device, which turns every tensor the factory
creates — and caches for the dataset to read — into a tensor without data. A process that builds no
model (the checkpointer) measures one in a forked child that is thrown away, on the meta device when the
factory allows it (shapes only: the child stays small whatever the model).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable, Iterable

import torch
from cmemi.shared.config.schema import Config

MARGIN = 16 << 20
DEFAULT_CAP = 64 << 20  # cluster.max_message_bytes: null never means more than this
FALLBACK = 1 << 31  # logical bound when the model cannot be built
STEP_LOG_BATCH = 64  # a replay's entries in one `log_entries` at most (a log_req's `count`: services/*/steplog*)

_built: dict[str, int | None] = {}  # parameter + buffer bytes of the models this process built, by `_key`


def _key(cfg: Config) -> str:
    return f"{cfg.model.factory}{sorted(cfg.model.kwargs.items())!r}"


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of these tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def tensor_bytes(model: torch.nn.Module) -> int:
    return nbytes([*model.parameters(), *model.buffers()])


def record(cfg: Config, model: torch.nn.Module) -> None:
    """The model this process built for `cfg`: its size sizes the run's messages."""
    _built[_key(cfg)] = tensor_bytes(model)
    derive_max_message_bytes(cfg)


def model_bytes(cfg: Config) -> int | None:
    """Parameter + buffer bytes of the model; None when its factory fails (the service reports that itself)."""
    if _key(cfg) not in _built:
        _built[_key(cfg)] = _measure_in_child(cfg)
    return _built[_key(cfg)]


def _measure_in_child(cfg: Config) -> int | None:
    """The model's size, measured in a forked child: whatever the factory creates or caches dies with it. First on
    the meta device (shapes without data: the child stays at the interpreter's size whatever the model's; the
    checkpointer's budget, issue 34); a factory that cannot build there (it reads a tensor's values, loads
    weights) is built for real in a second child, its cache untouched by the first."""
    size = _in_child(cfg, meta=True)
    return size if size is not None else _in_child(cfg, meta=False)


def _in_child(cfg: Config, meta: bool) -> int | None:
    """One intra-op thread in the child: a fork after this process used OpenMP hangs on a second one."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (a child: coverage never sees it)
        os.close(r)
        try:
            from cmemi.shared.config.lookup import resolve

            def build(c: Config) -> torch.nn.Module:  # plugins.build_model's call, without recording (it records here)
                torch.manual_seed(c.run.seed)
                model: torch.nn.Module = resolve(c.model.factory, "model.factory")(**c.model.kwargs)
                return model

            torch.set_num_threads(1)
            os.write(w, struct.pack("<q", measure(cfg, build, meta)))
        except BaseException:  # the service itself builds nothing else here: any failure means "unknown"
            pass
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 8):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return struct.unpack("<q", data)[0] if len(data) == 8 else None


def measure(cfg: Config, build: Callable[[Config], torch.nn.Module], meta: bool) -> int:
    """Parameter + buffer bytes of the model `build` makes, on the meta device if `meta` (only in a process that is
    thrown away: the factory's caches would hold tensors without data)."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        return tensor_bytes(build(cfg))


def _derived(cfg: Config) -> int:
    size = model_bytes(cfg)
    if size is None:
        return FALLBACK
    # with local steps the leader's snapshot also holds every replica's inner state: up to two optimizer copies
    # (Adam's moments) and, streaming, the replica's own parameters (services/aggregator/common/replicas.py)
    states = cfg.train.microbatches * 3 * size if cfg.train.local_steps else 0
    # with train.state_every = D > 1 a server's snapshot also holds the versions a replay may start from, D − 1 of
    # its pieces besides the current ones (shared/core/history.py); none at D = 1, so the bound is the one before
    history = (cfg.train.state_every - 1) * size if cfg.train.local_steps else 0
    return 4 * size + states + history + MARGIN


def derive_max_message_bytes(cfg: Config) -> int:
    """Fill in cluster.max_message_bytes when it is null; returns the effective value."""
    if cfg.cluster.max_message_bytes is None:
        cfg.cluster.max_message_bytes = min(_derived(cfg), DEFAULT_CAP)
    return cfg.cluster.max_message_bytes


def logical_bytes(cfg: Config) -> int:
    """The most bytes of tensors a receiver accepts in one logical message (reassembled from parts)."""
    return max(_derived(cfg), derive_max_message_bytes(cfg))

