"""CPU a step log entry costs the checkpointer to land: the log's sink, the copy out of the server's shared-memory slot
(as services/checkpointer/logserver.py does for a same-host server), `add`, and a checkpoint every 20 entries, all on
one thread, no sockets (issue 45: the checkpointer's part of the small-step floor). Two entry shapes: cnn1d's six
small tensors and a 2.4 MB MLP slice (bench/recovery.py's size). Run it in two checkouts to compare them:

    .venv/bin/python bench/steplog_landing.py [--entries 400] [--repeats 5]
    /path/to/other/checkout/.venv/bin/python bench/steplog_landing.py

Each entry is also written through to the log's segment file (services/checkpointer/logfiles.py, as the checkpointer
does with checkpoint.step_log_spool on) in a temporary directory (`--dir`: on the run directory's file system);
`--spool off` leaves that out (the log in memory only), `--fsync` adds an fsync of the segment after every entry (what
a host's death would need; not what the checkpointer does). A checkout before the spool ignores both.

Prints one JSON object: per shape, the median and the range of CPU microseconds per entry over the repeats, and the
median wall-clock microseconds (an fsync waits for the disk: wall time, not CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from cmemi.services.checkpointer import steplog
from cmemi.services.checkpointer.steplog import Held, StepLog
from cmemi.shared.wire.protocol import DTYPE_NAMES, tensor_bytes

SHAPES = {"cnn1d": [(16, 1, 5), (16,), (32, 16, 5), (32,), (10, 256), (10,)],
          "mlp_2.4MB": [(512, 1024), (512,), (64, 512), (64,)]}


def files_in(root: str | None, spool: bool):
    """The log's segments in a new directory under `root` (None: no spool, or a checkout before it)."""
    try:
        from cmemi.services.checkpointer.logfiles import LogFiles
    except ImportError:
        return None
    if not spool:
        return None

    def full(exc: OSError, attempt: int) -> None:
        raise exc

    return LogFiles(tempfile.mkdtemp(prefix="steplog-landing-", dir=root), full)


def land(shapes: list[tuple[int, ...]], entries: int, root: str | None = None, spool: bool = True,
         fsync: bool = False) -> tuple[float, float]:
    """CPU and wall-clock microseconds per entry landed (sink, copy, add, written through; a checkpoint every 20)."""
    src = {f"g.p{i}": torch.randn(s) for i, s in enumerate(shapes)}
    metas = [{"name": n, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "nbytes": t.nbytes}
             for n, t in src.items()]
    files = files_in(root, spool)
    log = StepLog(0, 1 << 40, lambda _h, _m: None, *([files] if files is not None else []))  # type: ignore[arg-type,return-value]  # never spills
    desc = {"seg": "bench", "slot": 0, "at": [0] * len(metas), "tensors": metas}
    raw = steplog.SlotBytes() if hasattr(steplog, "SlotBytes") else None  # (absent in a checkout before it)
    # with the spool on, logserver.py writes a same-host entry into the segment straight from the slot (`Streamed`:
    # here a buffer laid out as a slot, unmapped never); in checkouts before that it landed through one reused buffer,
    # laid out once per slot layout (`SlotBytes.landed`), or a `Held` on that buffer before that
    streamed = files is not None and hasattr(steplog, "Streamed")
    laid = files is not None and raw is not None and hasattr(raw, "landed")
    landing = torch.empty(Held.size(metas), dtype=torch.uint8) if files is not None and hasattr(Held, "size") else None
    if streamed:
        slot = torch.zeros(Held.size(metas), dtype=torch.uint8)
        at = Held.starts_of(metas)
        for a, m in zip(at, metas, strict=True):
            slot[a:a + m["nbytes"]] = torch.frombuffer(bytearray(tensor_bytes(src[m["name"]])), dtype=torch.uint8)
        data, xmetas = tensor_bytes(slot), [{**m, "xxh": None} for m in metas]
    t0, w0 = time.thread_time(), time.perf_counter()
    for s in range(1, entries + 1):
        if streamed:
            log.add(0, {"step": s}, steplog.Streamed(xmetas, at, data, 8 << 20, lambda _lo, _hi: None, lambda: True))
            if fsync and files is not None:
                os.fsync(files.segments[-1].fd)
            if s % 20 == 0:
                log.covered(s)
            continue
        if laid:
            assert raw is not None
            landed = raw.landed(desc, src)
            landed.fill()
            log.add(0, {"step": s}, landed)
            if fsync and files is not None:
                os.fsync(files.segments[-1].fd)
            if s % 20 == 0:
                log.covered(s)
            continue
        sink = Held(metas, landing) if landing is not None and raw is not None else log.sink({"step": s, "shard": 0}, metas)
        assert isinstance(sink, Held)
        if raw is not None:  # as services/checkpointer/logserver.py lands a same-host entry
            sink.fill(raw.of(desc, src))
            log.add(0, {"step": s}, sink.pieces())
            if fsync and files is not None:
                os.fsync(files.segments[-1].fd)
            if s % 20 == 0:
                log.covered(s)
            continue
        for ti, m in enumerate(metas):
            sink.write(ti, 0, tensor_bytes(src[m["name"]]))
        log.add(0, {"step": s}, sink.result())
        if s % 20 == 0:
            log.covered(s)
    cpu, wall = 1e6 * (time.thread_time() - t0) / entries, 1e6 * (time.perf_counter() - w0) / entries
    if files is not None:
        files.covered(entries)
        os.rmdir(files.root)
    return cpu, wall


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--spool", choices=("on", "off"), default="on", help="write each entry through to a segment file")
    p.add_argument("--fsync", action="store_true", help="fsync the segment after every entry")
    p.add_argument("--dir", default=None, help="where the segments go (default: the system's temporary directory)")
    args = p.parse_args(argv)
    out = {}
    for name, shapes in SHAPES.items():
        runs = [land(shapes, args.entries, args.dir, args.spool == "on", args.fsync) for _ in range(args.repeats)]
        us = [cpu for cpu, _ in runs]
        out[name] = {"cpu_us_per_entry_median": round(statistics.median(us), 1),
                     "range": [round(min(us), 1), round(max(us), 1)],
                     "wall_us_per_entry_median": round(statistics.median(w for _, w in runs), 1)}
    print(json.dumps({"bench": "steplog_landing", "entries": args.entries, "repeats": args.repeats,
                      "spool": args.spool, "fsync": args.fsync, "torch_threads": torch.get_num_threads(),
                      "shapes": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
