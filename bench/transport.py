"""Gradient ingest rate of the aggregator's receive path against raw ZeroMQ and a plain memory copy.

Two processes on loopback, PUSH -> PULL (tcp://127.0.0.1), one thread each. For each message size
(a gradient of S bytes split into 4 float32 tensors, like the layers of a model):

  raw          receive the multipart message (copy=False), nothing else: the ceiling of the socket
  raw_sum      receive + sum the tensors in m order (StepCollector), without decoding: the cost of the sum alone
  protocol     receive + shared.protocol.decode (checksum on: xxh3 of every frame) + StepCollector.offer
               in m order (M messages per step) + mean
  protocol_nocheck   the same with the checksum off (cluster.checksum: false)
  memcpy       one in-process copy of the same bytes (torch copy_ into a preallocated buffer)

The sender encodes each message once (the workers' encode and checksum run on other processes in a real
cluster) and sends the same frames again and again, zero-copy. The receiver measures bytes per second
from the first to the last message of a burst. Variants alternate within each repeat; medians over repeats.

    .venv/bin/python bench/transport.py [--quick] [--sizes-mib 1,4,16,64] [--repeats R]

Prints one JSON object; `ratio_protocol_vs_raw[size]` is protocol / raw (target >= 0.8).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402

RUN = "bench-transport"
M = 4  # microbatches per step in the protocol variant
VARIANTS = ("raw", "raw_sum", "protocol", "protocol_nocheck", "protocol_check_each")


def codec_for(variant: str):
    """The aggregator's gradient codec (compression.codec: none): no NaN/inf check per message (the aggregator
    checks the step's sum instead); protocol_check_each: with the check on every message (a step's second
    collection after a non-finite sum, and what every step did before)."""
    from cmemi.shared.compression.registry import make_codec
    from cmemi.shared.config.system import CompressionConfig

    return make_codec(CompressionConfig(), check_finite=variant == "protocol_check_each")


def leased_collector(M: int) -> Any:
    """A step collector with every microbatch leased to the one sender here ("w0", 1)."""
    from cmemi.services.aggregator.common.collector import StepCollector

    collector = StepCollector(0, M)
    for _ in range(M):
        collector.lease("w0", 1, now=0.0, timeout=float("inf"))
    return collector


def grad_fields(m: int) -> dict[str, Any]:
    """Header fields of a `grad` message, whatever fields this version's schema requires."""
    from cmemi.shared.wire import schema as wire_schema

    fields: dict[str, Any] = {"wid": "w0", "inc": 1, "term": 1, "step": 0, "lo": m, "hi": m + 1, "version": 0,
                              "losses": [1.0], "n": 1,
                              "finite": True, "encode_s": 0.0}
    schema = wire_schema.required("grad")
    for key, types in schema.items():
        if key not in fields and key != "tensors":
            fields[key] = next((t() for t in types if t is not type(None)), None)
    return {k: v for k, v in fields.items() if k in schema}


def grad_messages(grads: dict[str, Any], variant: str, checksum: bool) -> list[list[Any]]:
    """The M `grad` messages of one step, encoded as a worker would (codec `none`)."""
    from cmemi.shared.wire import protocol
    from cmemi.shared.wire import schema as wire_schema

    codec = codec_for(variant)
    msgs = []
    for m in range(M):
        fields, tensors = grad_fields(m), grads
        if codec is not None and "codec" in wire_schema.required("grad"):
            fields["codec"], tensors = codec.encode(grads, 0)
        msgs.append(protocol.encode("grad", RUN, fields, tensors, checksum))
    return msgs


def _parts(size: int) -> list[int]:
    n = size // 4
    return [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8]


def make_grads(size: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(k, generator=g) for i, k in enumerate(_parts(size))}


# ---------------------------------------------------------------------------------------- sender process
def sender(data_addr: str, ctl_addr: str) -> None:
    """Serve requests "variant size count" on a REP socket by sending `count` messages on PUSH."""
    import zmq
    from cmemi.shared.wire import protocol

    C.pin_threads(1)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 4)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(data_addr)
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.connect(ctl_addr)
    cache: dict[tuple[str, int], list[list[Any]]] = {}
    while True:
        req = rep.recv_string()
        if req == "quit":
            rep.send_string("bye")
            break
        variant, size_s, count_s = req.split()
        size, count = int(size_s), int(count_s)
        key = (variant, size)
        if key not in cache:
            cache.clear()  # keep one size in memory
            cache[key] = grad_messages(make_grads(size), variant, checksum=variant in ("protocol", "protocol_check_each"))
        rep.send_string("go")
        msgs = cache[key]
        for i in range(count):
            protocol.send(push, msgs[i % M])
    push.close()
    rep.close()
    ctx.term()


# ---------------------------------------------------------------------------------------- receiver
def receive_burst(pull, req, variant: str, size: int, count: int) -> tuple[float, float]:
    """Bytes per second over messages 2..count of one burst (the first one starts the clock), and the
    receiving process's CPU seconds per GB (all its threads: ZeroMQ's I/O thread included)."""
    from cmemi.shared.compression.base import all_finite
    from cmemi.shared.wire import protocol

    req.send_string(f"{variant} {size} {count}")
    assert req.recv_string() == "go"
    nbytes = 0
    t0 = 0.0
    collector = leased_collector(M)
    codec = codec_for(variant) if variant.startswith("protocol") else None
    shapes = {f"layer{i}.weight": (n,) for i, n in enumerate(_parts(size))} if codec else None
    for i in range(count):
        frames = pull.recv_multipart(copy=False)
        if variant == "raw":
            pass
        elif variant == "raw_sum":
            import torch

            tensors = {str(k): torch.frombuffer(f.buffer, dtype=torch.float32) for k, f in enumerate(frames[1:])}
            if collector.offer(i % M, tensors, 0.0, ("w0", 1)) is not None:
                raise RuntimeError("collector refused a gradient")
        else:
            msg = protocol.decode(frames, RUN, checksum=variant in ("protocol", "protocol_check_each"))
            grads = msg.tensors
            if codec is not None and "codec" in msg.header:  # as the aggregator: codec decode (none: views)
                grads = codec.decode(msg.header["codec"], msg.tensors, shapes=shapes)
            if collector.offer((msg.header["lo"], msg.header["hi"]), grads, msg.header["losses"], ("w0", 1)) is not None:
                raise RuntimeError("collector refused a gradient")
        if variant != "raw" and collector.complete:
            mean, _ = collector.mean()
            if variant.startswith("protocol") and not all_finite(mean.values()):  # as the aggregator, per step
                raise RuntimeError("the sum is not finite")
            collector = leased_collector(M)
        if i == 0:
            t0, c0 = time.perf_counter(), time.process_time()
        else:
            nbytes += protocol.message_bytes(frames)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return nbytes / dt, dc / (nbytes / 1e9)


def stage_breakdown(size: int, reps: int) -> dict[str, float]:
    """CPU seconds per GB of each stage of the aggregator's receive path, in-process on received-like
    buffers (fresh writable memory, as ZeroMQ hands over): checksum, codec decode (+ NaN/inf check),
    and the ordered sum (StepCollector.offer x M + mean)."""
    import gc

    from cmemi.shared.wire import protocol

    grads = make_grads(size)
    shapes = {k: tuple(v.shape) for k, v in grads.items()}
    codec = codec_for("protocol")
    batch = grad_messages(grads, "protocol", checksum=True)
    gb = size * M * reps / 1e9
    out: dict[str, float] = {}

    def fresh():  # new writable buffers each time, like received frames
        return [[bytes(parts[0]), *[memoryview(bytearray(p_)) for p_ in parts[1:]]] for parts in batch]

    for key, checksum in (("decode_with_checksum", True), ("decode_without_checksum", False)):
        total = 0.0
        for _ in range(reps):
            frames = fresh()
            gc.collect()
            t = time.process_time()
            for f in frames:
                protocol.decode(f, RUN, checksum)
            total += time.process_time() - t
        out[key] = total / gb
    decoded = [protocol.decode(f, RUN, False) for f in fresh()]
    for key, variant in (("codec_decode_with_finite_check", "protocol_check_each"),
                         ("codec_decode_no_finite_check", "protocol")):
        c = codec_for(variant)
        if c is None or "codec" not in decoded[0].header:
            continue
        t = time.process_time()
        for _ in range(reps):
            for msg in decoded:
                c.decode(msg.header["codec"], msg.tensors, shapes=shapes)
        out[key] = (time.process_time() - t) / gb
    total = 0.0
    for _ in range(reps):
        msgs = [protocol.decode(f, RUN, False) for f in fresh()]
        gc.collect()
        t = time.process_time()
        coll = leased_collector(M)
        for msg in msgs:
            grads_m = (codec_for("protocol").decode(msg.header["codec"], msg.tensors, shapes=shapes)
                       if codec is not None and "codec" in msg.header else msg.tensors)
            coll.offer((msg.header["lo"], msg.header["hi"]), grads_m, msg.header["losses"], ("w0", 1))
        coll.mean()
        total += time.process_time() - t
    out["ordered_sum_and_mean"] = total / gb - out.get("codec_decode_no_finite_check", 0.0)
    return {k: round(v, 4) for k, v in out.items()}


def memcpy_rate(size: int, reps: int) -> float:
    """One copy of `size` bytes into a preallocated buffer, cycling over enough buffers (>= 128 MiB) that
    they are not cache-resident, like freshly received frames."""
    import torch

    k = max(2, (128 << 20) // size)
    srcs = [torch.randn(size // 4) for _ in range(k)]
    dsts = [torch.empty_like(srcs[0]) for _ in range(k)]
    for s_, d_ in zip(srcs, dsts, strict=True):
        d_.copy_(s_)
    reps = max(reps, k)
    t0 = time.perf_counter()
    for i in range(reps):
        dsts[i % k].copy_(srcs[(i + 1) % k])
    return size * reps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes-mib", default="1,4,16,64")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--mib-per-burst", type=int, default=None, help="bytes per measurement burst (MiB)")
    p.add_argument("--_sender", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._sender:
        sender(*args._sender)
        return
    C.setup(threads=1)
    import zmq

    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mib.split(",")]
    repeats = args.repeats or (3 if args.quick else 7)
    burst = (args.mib_per_burst or (128 if args.quick else 512)) << 20
    result: dict[str, Any] = {"bench": "transport", **C.provenance(), "machine": C.machine(), "quick": args.quick,
                              "microbatches_per_step": M, "repeats": repeats}
    t_start = time.monotonic()
    work = C.workdir("transport")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 4)
    pull.setsockopt(zmq.LINGER, 0)
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, 60_000)
    group = None
    try:
        data_port = pull.bind_to_random_port("tcp://127.0.0.1")
        ctl_port = req.bind_to_random_port("tcp://127.0.0.1")
        group = C.ProcGroup([C.PY, str(Path(__file__).resolve()), "--_sender", f"tcp://127.0.0.1:{data_port}",
                             f"tcp://127.0.0.1:{ctl_port}"], work / "sender.log")
        rates: dict[int, dict[str, list[float]]] = {s: {v: [] for v in (*VARIANTS, "memcpy")} for s in sizes}
        cpu: dict[int, dict[str, list[float]]] = {s: {v: [] for v in VARIANTS} for s in sizes}
        breakdown: dict[int, dict[str, float]] = {}
        for size in sizes:
            count = max(8, burst // size)
            count += (-count) % M
            C.log(f"{size >> 20} MiB x {count} messages per burst")
            for v in VARIANTS:  # warm-up: encode once on the sender, touch pages on both sides
                receive_burst(pull, req, v, size, M * 2)
            for r in range(repeats):
                order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
                for v in order:
                    rate, cpu_gb = receive_burst(pull, req, v, size, count)
                    rates[size][v].append(rate)
                    cpu[size][v].append(cpu_gb)
                rates[size]["memcpy"].append(memcpy_rate(size, max(4, count // 2)))
            breakdown[size] = stage_breakdown(size, max(2, (64 << 20) // (size * M)))
        req.send_string("quit")
        req.recv_string()
        group.wait(10)
        table: dict[str, Any] = {}
        ratios: dict[str, Any] = {}
        for size, by in rates.items():
            key = f"{size / (1 << 20):g}MiB"
            med = {v: C.median(xs) for v, xs in by.items()}
            table[key] = {v: {"GB_s_median": round(x / 1e9, 3), "GB_s_all": [round(y / 1e9, 3) for y in by[v]]}
                          for v, x in med.items()}
            for v in VARIANTS:
                table[key][v]["receiver_cpu_s_per_GB"] = round(C.median(cpu[size][v]), 3)
            ratios[key] = {
                "protocol_vs_raw": C.ratio(med["protocol"], med["raw"]),
                "protocol_nocheck_vs_raw": C.ratio(med["protocol_nocheck"], med["raw"]),
                "protocol_check_each_vs_raw": C.ratio(med["protocol_check_each"], med["raw"]),
                "raw_sum_vs_raw": C.ratio(med["raw_sum"], med["raw"]),
                # the protocol's own cost (header, checksum, decode, NaN/inf check) over a receiver that also sums
                "protocol_vs_raw_sum": C.ratio(med["protocol"], med["raw_sum"]),
                # the same comparison by the receiver's CPU cost per byte (less sensitive to other jobs' load)
                "protocol_vs_raw_by_receiver_cpu": C.ratio(C.median(cpu[size]["raw"]), C.median(cpu[size]["protocol"])),
                "raw_vs_memcpy": C.ratio(med["raw"], med["memcpy"]),
                "protocol_vs_memcpy": C.ratio(med["protocol"], med["memcpy"]),
            }
        result["throughput"] = table
        result["receive_path_cpu_s_per_GB"] = {f"{s_ / (1 << 20):g}MiB": b for s_, b in breakdown.items()}
        result["ratio_protocol_vs_raw"] = {k: v["protocol_vs_raw"] for k, v in ratios.items()}
        result["ratios"] = ratios
        result["target_protocol_vs_raw_ge_0.8"] = all((v or 0) >= 0.8 for v in result["ratio_protocol_vs_raw"].values())
        result["notes"] = [
            "throughput = gradient bytes per second ingested by the receiving process (GB = 1e9 bytes)",
            "protocol = receive + decode (xxh3 checksum on) + gradient codec decode (compression.codec none) + "
            "StepCollector.offer in m order + mean + one NaN/inf check of the mean per step, as the aggregator does",
            "protocol_nocheck: the same with cluster.checksum false; protocol_check_each: checksum on and a NaN/inf check "
            "of every message (the aggregator's path while it collects a step again after a non-finite sum)",
            "raw = PUSH/PULL recv_multipart(copy=False) of the same frames, nothing else; raw_sum adds the sum only",
            "2 shared cores: sender and receiver run one torch thread each, plus one ZeroMQ I/O thread each; loopback "
            "TCP copies every byte in the kernel, so all four threads compete for 2 cores and any work in the "
            "receiving thread (decode, checksum, sum) slows ingest almost one for one",
            "receiver_cpu_s_per_GB: CPU seconds of the whole receiving process (all threads) per GB ingested",
            "receive_path_cpu_s_per_GB: each stage alone, in-process on fresh buffers (decode with/without the xxh3 "
            "checksum, the codec's decode with/without its NaN/inf check, StepCollector offer x M + mean)",
            "memcpy: one copy into a preallocated buffer, cycling over >= 128 MiB of buffers (not cache-resident)",
        ]
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        raise
    finally:
        if group is not None:
            group.stop(grace=2)
        C.stop_all_groups()
        pull.close()
        req.close()
        ctx.term()
        shutil.rmtree(work, ignore_errors=True)
        result["bench_wall_s"] = round(time.monotonic() - t_start, 1)
        C.emit_result(result)  # also on failure or interruption: the partial result, with "error"


if __name__ == "__main__":
    main()
