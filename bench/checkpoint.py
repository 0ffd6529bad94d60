"""Checkpoint cost: training stall per checkpoint, write throughput vs model size, disk use under retention.

1. Real runs (`cmemi up`, 1 worker, checkpoint.every_steps = E, keep_last = K) for models of about
   1 MB .. 40 MB of parameters: the aggregator's in-memory snapshot time (summary.json
   checkpoint_stall_s_median), the checkpointer's write_s and bytes (checkpoint_saved events), the step
   time of the steps that follow a snapshot against the others (the stall training actually sees, the
   checkpointer's disk work on the shared cores included), and the disk use of RUN_DIR/checkpoints
   after the run against K (+ the final checkpoint).
2. The store alone (services.checkpointer.store.CheckpointStore.write: safetensors, xxh3-128 manifest,
   fsyncs, atomic rename) for 1 MB .. 1 GB of float32 parameters, against a plain write+fsync of the
   same bytes, and the restore (verify + load) throughput.

    .venv/bin/python bench/checkpoint.py [--quick] [--store-sizes-mib 1,16,128,1024]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ---------------------------------------------------------------------------------------- 1. real runs
def real_run(work: Path, params: int, steps: int, every: int, keep_last: int) -> dict[str, Any]:
    from bench.models import hidden_for_params

    hidden = hidden_for_params(params, 256, 3)
    wl = {"model": {"factory": "bench.models:mlp", "kwargs": {"in_dim": 256, "hidden": hidden, "depth": 3}},
          "data": {"factory": "bench.models:synthetic", "kwargs": {"n": 2048, "shape": [256]}},
          "global_batch": 64, "lr": 0.01}
    name = f"ckpt_{params}"
    cfg = C.cmemi_config(name, work / name, wl, steps=steps, microbatches=1, workers=1, ckpt_every=every,
                         keep_last=keep_last)
    t0 = time.time()
    with C.CmemiRun(cfg, work) as run:
        rc = run.wait(timeout=600)
        if rc != 0:
            raise RuntimeError(f"cmemi up failed ({rc}): {run.group.tail()}")
        summ, events, metrics = run.summary() or {}, run.events(), run.metrics()
    saved = [e for e in events if e["kind"] == "checkpoint_saved"]
    intermediate = [e for e in saved if e["step"] < steps]
    after = [m["step_time_s"] for m in metrics if m["step"] > every and m["step"] % every == 1]
    other = [m["step_time_s"] for m in metrics if m["step"] > 3 and m["step"] % every != 1]
    ck = work / name / "checkpoints"
    dirs = sorted(p.name for p in ck.iterdir() if p.is_dir()) if ck.exists() else []
    size = C.median(e["bytes"] for e in saved)
    disk = du(ck) if ck.exists() else 0
    return {
        "params": params, "param_MB": round(params * 4 / 1e6, 2), "steps": steps, "every_steps": every,
        "keep_last": keep_last, "checkpoints_saved": len(saved),
        "snapshot_stall_s_median": C.rnd(summ.get("checkpoint_stall_s_median"), 5),
        "write_s_median": C.rnd(C.median(e.get("write_s") for e in intermediate or saved), 4),
        "checkpoint_MB": round(size / 1e6, 2) if size else None,
        "write_MB_s_median": C.rnd(C.median(e["bytes"] / e["write_s"] / 1e6 for e in saved if e.get("write_s")), 1),
        "step_time_after_snapshot_median_s": C.rnd(C.median(after), 5),
        "step_time_other_median_s": C.rnd(C.median(other), 5),
        "visible_stall_s": C.rnd((C.median(after) or 0) - (C.median(other) or 0), 5) if after and other else None,
        "disk": {"dirs": dirs, "count": len(dirs), "bytes": disk,
                 "expected_max_count": keep_last + 1,  # + the final checkpoint (always kept)
                 "bytes_per_checkpoint": round(disk / len(dirs)) if dirs else None,
                 "within_retention": len(dirs) <= keep_last + 1},
        "run_wall_s": round(time.time() - t0, 1),
    }


# ---------------------------------------------------------------------------------------- 2. the store
def store_sizes(work: Path, size_mib: float, repeats: int) -> dict[str, Any]:
    import torch
    from cmemi.services.checkpointer.store import CheckpointStore

    nbytes = int(size_mib * (1 << 20))
    n = nbytes // 4
    parts = [n // 2, n // 4, n - n // 2 - n // 4]
    tensors = {f"model.layer{i}.weight": torch.randn(k) for i, k in enumerate(parts)}
    tensors["optimizer.state.step"] = torch.zeros(1)
    meta = {"bench": True}
    root = work / f"store-{size_mib:g}"
    store = CheckpointStore(root)
    writes, raws, loads = [], [], []
    for r in range(repeats):
        t = time.perf_counter()
        path = store.write(r + 1, meta, tensors)
        writes.append(time.perf_counter() - t)
        t = time.perf_counter()
        _meta, loaded = store.load(path)
        loads.append(time.perf_counter() - t)
        del loaded
        shutil.rmtree(path)
        # the same bytes with a plain write + fsync (the disk's own rate here)
        raw = root / "raw.bin"
        t = time.perf_counter()
        with open(raw, "wb") as f:
            for v in tensors.values():
                f.write(memoryview(v.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        raws.append(time.perf_counter() - t)
        raw.unlink()
    shutil.rmtree(root, ignore_errors=True)
    w, rw, ld = C.median(writes), C.median(raws), C.median(loads)
    return {"MiB": size_mib, "write_s_median": round(w, 4), "write_MB_s": round(nbytes / w / 1e6, 1),
            "raw_write_fsync_MB_s": round(nbytes / rw / 1e6, 1), "store_vs_raw": C.ratio(rw, w),
            "restore_MB_s": round(nbytes / ld / 1e6, 1), "write_s_all": [round(x, 4) for x in writes]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--run-params", default=None, help="comma-separated parameter counts of the real runs")
    p.add_argument("--store-sizes-mib", default=None)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    C.setup(threads=1)
    run_params = [int(float(x)) for x in (args.run_params or ("250e3,2.5e6" if args.quick else "250e3,2.5e6,10e6")).split(",")]
    sizes = [float(x) for x in (args.store_sizes_mib or ("1,16,128,1024" if args.quick else "1,16,128,512,1024")).split(",")]
    repeats = 2 if args.quick else 3
    work = C.workdir("checkpoint")
    result: dict[str, Any] = {"bench": "checkpoint", **C.provenance(), "machine": C.machine(), "quick": args.quick}
    t_start = time.monotonic()
    try:
        runs = []
        for i, params in enumerate(run_params):
            long_run = i == 0  # the smallest model: a long run with many checkpoints, for retention
            steps = (200 if args.quick else 400) if long_run else (60 if args.quick else 100)
            C.log(f"real run: {params} parameters, {steps} steps, checkpoint every {args.every}")
            runs.append(real_run(work, params, steps, args.every, args.keep_last))
        result["real_runs"] = runs
        store = []
        for s in sizes:
            C.log(f"store: {s:g} MiB")
            store.append(store_sizes(work, s, 1 if s >= 512 else repeats))
        result["store"] = store
        result["summary"] = {
            "snapshot_stall_s_by_param_MB": {str(r["param_MB"]): r["snapshot_stall_s_median"] for r in runs},
            "visible_stall_s_by_param_MB": {str(r["param_MB"]): r["visible_stall_s"] for r in runs},
            "run_write_MB_s_by_param_MB": {str(r["param_MB"]): r["write_MB_s_median"] for r in runs},
            "store_write_MB_s_by_MiB": {f"{s['MiB']:g}": s["write_MB_s"] for s in store},
            "store_vs_raw_by_MiB": {f"{s['MiB']:g}": s["store_vs_raw"] for s in store},
            "retention_ok": all(r["disk"]["within_retention"] for r in runs),
        }
        result["notes"] = [
            "snapshot_stall_s: the aggregator's in-memory copy of the state (training waits for it); the disk "
            "write runs in the checkpointer process",
            "visible_stall_s: median step time of the steps right after a snapshot minus the median of the others "
            "(2 shared cores: the checkpointer's hashing/writing competes with training for CPU)",
            "a checkpoint holds parameters + optimizer state (SGD momentum: about 2x the parameter bytes)",
            "store: CheckpointStore.write = safetensors files + xxh3-128 manifest + fsyncs + atomic rename; "
            "raw = one write() of the same bytes + fsync; restore = verify (xxh3-128) + load",
        ]
    except BaseException as exc:
        C.record_error(result, exc)
        raise
    finally:
        C.finish(result, work, args.keep, t_start)


if __name__ == "__main__":
    main()
