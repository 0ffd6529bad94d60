"""CPU a step log entry costs the checkpointer to land: the log's sink, the copy out of the server's shared-memory slot
(as services/checkpointer/logserver.py does for a same-host server), `add`, and a checkpoint every 20 entries, all on
one thread, no sockets (issue 45: the checkpointer's part of the small-step floor). Two entry shapes: cnn1d's six
small tensors and a 2.4 MB MLP slice (bench/recovery.py's size). Run it in two checkouts to compare them:

    .venv/bin/python bench/steplog_landing.py [--entries 400] [--repeats 5]
    /path/to/other/checkout/.venv/bin/python bench/steplog_landing.py

Prints one JSON object: per shape, the median and the range of CPU microseconds per entry over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from cmemi.services.checkpointer import steplog
from cmemi.services.checkpointer.steplog import Held, StepLog
from cmemi.shared.wire.protocol import DTYPE_NAMES, tensor_bytes

SHAPES = {"cnn1d": [(16, 1, 5), (16,), (32, 16, 5), (32,), (10, 256), (10,)],
          "mlp_2.4MB": [(512, 1024), (512,), (64, 512), (64,)]}


def land(shapes: list[tuple[int, ...]], entries: int) -> float:
    """CPU microseconds per entry landed (sink, copy, add; a checkpoint every 20)."""
    src = {f"g.p{i}": torch.randn(s) for i, s in enumerate(shapes)}
    metas = [{"name": n, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "nbytes": t.nbytes}
             for n, t in src.items()]
    log = StepLog(0, 1 << 40, lambda _h, _m: None)  # type: ignore[arg-type,return-value]  # never spills
    desc = {"seg": "bench", "slot": 0, "at": [0] * len(metas), "tensors": metas}
    raw = steplog.SlotBytes() if hasattr(steplog, "SlotBytes") else None  # (absent in a checkout before it)
    t0 = time.thread_time()
    for s in range(1, entries + 1):
        sink = log.sink({"step": s, "shard": 0}, metas)
        assert isinstance(sink, Held)
        if raw is not None:  # as services/checkpointer/logserver.py lands a same-host entry
            sink.fill(raw.of(desc, src))
            log.add(0, {"step": s}, sink.pieces())
            continue
        for ti, m in enumerate(metas):
            sink.write(ti, 0, tensor_bytes(src[m["name"]]))
        log.add(0, {"step": s}, sink.result())
        if s % 20 == 0:
            log.covered(s)
    return 1e6 * (time.thread_time() - t0) / entries


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    out = {}
    for name, shapes in SHAPES.items():
        us = [land(shapes, args.entries) for _ in range(args.repeats)]
        out[name] = {"cpu_us_per_entry_median": round(statistics.median(us), 1),
                     "range": [round(min(us), 1), round(max(us), 1)]}
    print(json.dumps({"bench": "steplog_landing", "entries": args.entries, "repeats": args.repeats,
                      "torch_threads": torch.get_num_threads(), "shapes": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
