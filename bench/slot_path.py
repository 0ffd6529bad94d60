"""Per-call cost of the same-host shared-memory slot path against the socket it replaces, in one process.

Issue 45's small-step floor: a 1-D CNN of 18 kB of parameters ran slower with 2 workers than before slots came
(bench/results/floor_small.json). A whole step cannot be timed to a few microseconds on a shared machine, so this
times the functions themselves in CPU time, best of 5 rounds of N calls each (the least disturbed round), for a flat
model of S parameter bytes (one float32 frame, as a small model's gradient and parameters travel):

  reader_views       shm_reader.Reader.views of a gradient's descriptor (the leader, per gradient)
  writer_write       shm.Writer.write of a gradient (a worker, per gradient)
  slot_descriptor    SlotPublisher.descriptor of a new version (the leader, per step)
  grad_socket        a gradient over ipc://: encode, send, receive, decode (protocol.encode/decode)
  grad_slot          the same gradient through a slot: write, the descriptor's message over ipc://, views, intact,
                     and a copy into a kept buffer (what the leader does when no sibling gradient waits)
  params_socket      a version over ipc://: Publisher.encoded (the copy into flat buffers), the work message, its
                     decode, and the worker's copy into its own flat buffers
  params_slot        the same through a slot: SlotPublisher.descriptor, the work message with the descriptor, its
                     decode, views, intact (the worker computes on the views: no copy)

    .venv/bin/python bench/slot_path.py [--quick] [--sizes-kib 4,18,64,256,1024]

Prints one JSON object: CPU microseconds per call by size (`us`), and `slot_over_socket` (grad_slot / grad_socket and
params_slot / params_socket; below 1: the slot is cheaper). Run it at two commits to compare the slot path.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402

RUN = "bench-slot-path"
GRAD = {"wid": "w0", "inc": 1, "term": 1, "step": 1, "lo": 0, "hi": 2, "version": 1, "losses": [0.5, 0.4], "n": 50,
        "finite": True, "codec": {"*flat": {"codec": "flat", "layout": "0" * 16}}, "encode_s": 0.0}
WORK = {"term": 1, "step": 1, "lo": 0, "hi": 2, "version": 1, "scale": 1.0, "layout": "0" * 16}


def best_us(fn: Callable[[], Any], n: int) -> float:
    """CPU microseconds per call of `fn` (this process's every thread: ZeroMQ's I/O thread too), the best of 5 rounds:
    CPU time, not wall, so that waiting for a core on a busy machine is not counted."""
    fn()
    return round(min(timeit.repeat(fn, number=n, repeat=5, timer=time.process_time)) / n * 1e6, 2)


def measure(nbytes: int, n: int, ipc: str) -> dict[str, float]:
    import torch
    import zmq
    from cmemi.services.aggregator.common.publish import Publisher, SlotPublisher
    from cmemi.shared.memory import shm, shm_reader
    from cmemi.shared.wire import protocol
    from cmemi.shared.wire.layout import Layout

    params = {"w": torch.randn(nbytes // 4 - 16), "b": torch.randn(16)}
    layout = Layout(params)
    flat = layout.pack(params)
    own = {k: torch.empty_like(v) for k, v in flat.items()}
    zctx = zmq.Context()
    tx, rx = zctx.socket(zmq.PAIR), zctx.socket(zmq.PAIR)
    tx.bind(ipc)
    rx.connect(ipc)
    writer, reader = shm.Writer(RUN, "worker", False), shm_reader.Reader(RUN, False)
    slots, publisher = SlotPublisher(RUN, "leader", False, layout), Publisher(False, layout)
    version = [0]
    try:
        descs = [writer.write(flat), writer.write(flat)]
        turn = [0]

        def views() -> None:
            turn[0] += 1
            reader.views(descs[turn[0] & 1])

        def descriptor() -> dict[str, Any]:
            version[0] += 1
            return slots.descriptor(params, version[0])

        def grad_socket() -> None:
            tx.send_multipart(protocol.encode("grad", RUN, GRAD, flat, False), copy=False)
            protocol.decode(rx.recv_multipart(copy=False), RUN, False)

        def grad_slot() -> None:
            tx.send_multipart(protocol.encode("grad", RUN, {**GRAD, "shm": writer.write(flat)}, {}, False), copy=False)
            d = protocol.decode(rx.recv_multipart(copy=False), RUN, False).header["shm"]
            with torch.no_grad():
                for k, v in reader.views(d).items():
                    own[k].copy_(v)
            reader.intact(d)

        def params_socket() -> None:
            version[0] += 1
            encoded, _ = publisher.encoded(params, version[0])
            tx.send_multipart(protocol.encode("work", RUN, WORK, encoded=encoded), copy=False)
            msg = protocol.decode(rx.recv_multipart(copy=False), RUN, False)
            with torch.no_grad():
                for k, v in msg.tensors.items():
                    own[k].copy_(v)

        def params_slot() -> None:
            tx.send_multipart(protocol.encode("work", RUN, {**WORK, "shm": descriptor()}, {}, False), copy=False)
            d = protocol.decode(rx.recv_multipart(copy=False), RUN, False).header["shm"]
            reader.views(d)
            reader.intact(d)

        return {"reader_views": best_us(views, n), "writer_write": best_us(lambda: writer.write(flat), n),
                "slot_descriptor": best_us(descriptor, n), "grad_socket": best_us(grad_socket, n),
                "grad_slot": best_us(grad_slot, n), "params_socket": best_us(params_socket, n),
                "params_slot": best_us(params_slot, n)}
    finally:
        writer.close()
        slots.close()
        tx.close(0)
        rx.close(0)
        zctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer calls per round")
    ap.add_argument("--sizes-kib", default="4,18,64,256,1024", help="flat model sizes in KiB")
    args = ap.parse_args()
    C.setup(threads=1)
    result: dict[str, Any] = {"bench": "slot_path", **C.provenance(), "machine": C.machine(), "us": {},
                              "slot_over_socket": {}}
    work = Path(tempfile.mkdtemp(prefix="cmemi-slot-path-"))
    try:
        for kib in (int(x) for x in args.sizes_kib.split(",")):
            n = (500 if args.quick else 3000) if kib <= 64 else (100 if args.quick else 500)
            C.log(f"slot_path: {kib} KiB, {n} calls per round")
            us = measure(kib << 10, n, f"ipc://{work}/s{kib}")
            result["us"][f"{kib}KiB"] = us
            result["slot_over_socket"][f"{kib}KiB"] = {
                "grad": C.ratio(us["grad_slot"], us["grad_socket"]),
                "params": C.ratio(us["params_slot"], us["params_socket"])}
    except Exception as exc:  # noqa: BLE001 - the JSON object says what failed
        C.record_error(result, exc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    C.emit_result(result)


if __name__ == "__main__":
    main()
