"""How step time and aggregator memory grow with the parameter count and with the number of workers.

1. Parameters: a 3-layer MLP of about 1M .. 64M parameters, 1 worker, a small batch (16), so the step is
   dominated by moving and applying parameters. Step time median (metrics.jsonl), bytes per step, and
   the aggregator's memory (VmRSS while training, VmHWM peak; /proc/PID/status, PID from its Redis member
   record), with the worker's for comparison.
2. Workers: 1, 2, 3 workers (train.microbatches = 6 for all, as CMEMI fixes M independently of the
   worker count) on the compute-bound CNN and (without --quick) the communication-bound MLP of
   bench/overhead.py. Speed-up = step time with 1 worker / with N.

2 shared CPU cores: 2 workers and the aggregator already share them, so 3 workers cannot be faster than 2
here; the worker sweep shows the trend and the contention, not the scaling of separate hosts.

    .venv/bin/python bench/scaling.py [--quick] [--params 1e6,4e6,16e6,64e6] [--workers 1,2,3]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench.models import WORKLOADS  # noqa: E402

WARMUP = 3


def measured_run(work: Path, name: str, wl: dict[str, Any], steps: int, workers: int, microbatches: int,
                 timeout: float = 600) -> dict[str, Any]:
    cfg = C.cmemi_config(name, work / name, wl, steps=steps, microbatches=microbatches, workers=workers)
    rss: dict[str, list[int]] = {"aggregator": [], "worker": []}
    hwm: dict[str, int] = {}
    faults: dict[str, list[tuple[int, int]]] = {"aggregator": [], "worker": []}  # (step, minflt)
    with C.CmemiRun(cfg, work) as run:
        pids: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while run.group.alive and time.monotonic() < deadline:
            step = run.step() if (run.run_dir / "cluster.json").exists() else 0
            if WARMUP < step < steps:
                if not pids:
                    try:
                        pids = {"aggregator": int(run.members("aggregator")["0"]["pid"]),
                                "worker": int(run.members("worker")["w0"]["pid"])}
                    except Exception:
                        pids = {}
                for role, pid in pids.items():
                    st = C.proc_status(pid)
                    if st:
                        rss[role].append(st["VmRSS"])
                        hwm[role] = max(hwm.get(role, 0), st["VmHWM"])
                    mf = C.minor_faults(pid)
                    if mf is not None:
                        faults[role].append((step, mf))
            time.sleep(0.1)
        rc = run.wait(timeout=max(1.0, deadline - time.monotonic()))
        if rc != 0:
            raise RuntimeError(f"cmemi up failed ({rc}): {run.group.tail()}")
        metrics = run.metrics()
    stats = C.step_stats(metrics, WARMUP)
    rows = [m for m in metrics if m["step"] > WARMUP]
    fps = {}
    for role, xs in faults.items():
        if len(xs) >= 2 and xs[-1][0] > xs[0][0]:
            fps[role] = round((xs[-1][1] - xs[0][1]) / (xs[-1][0] - xs[0][0]))
    out = {
        "step_time_median_s": C.rnd(stats.get("step_time_median_s"), 5),
        "minor_page_faults_per_step": fps,
        "wall_per_step_s": C.rnd(stats.get("wall_per_step_s"), 5),
        "bytes_in_per_step": C.median(m["bytes_in"] for m in rows),
        "bytes_out_per_step": C.median(m["bytes_out"] for m in rows),
        "aggregator_rss_MB": round(C.median(rss["aggregator"]) / 1e6, 1) if rss["aggregator"] else None,
        "aggregator_hwm_MB": round(hwm["aggregator"] / 1e6, 1) if "aggregator" in hwm else None,
        "worker_rss_MB": round(C.median(rss["worker"]) / 1e6, 1) if rss["worker"] else None,
        "worker_hwm_MB": round(hwm["worker"] / 1e6, 1) if "worker" in hwm else None,
    }
    return out


def mlp_workload(params: int, depth: int) -> tuple[dict[str, Any], int, int]:
    from bench.models import count_params, hidden_for_params, mlp

    hidden = hidden_for_params(params, 256, depth)
    model = mlp(256, hidden, depth)
    wl = {"model": {"factory": "bench.models:mlp", "kwargs": {"in_dim": 256, "hidden": hidden, "depth": depth}},
          "data": {"factory": "bench.models:synthetic", "kwargs": {"n": 1024, "shape": [256]}},
          "global_batch": 16, "lr": 0.01}
    return wl, count_params(model), max(p.numel() for p in model.parameters()) * 4


def param_sweep(work: Path, sizes: list[int], steps: int) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        wl, actual, largest = mlp_workload(n, 3)
        C.log(f"params {actual}: {steps} steps, 1 worker")
        r = measured_run(work, f"scale_p{n}", wl, steps, 1, 1)
        r = {"params": actual, "param_MB": round(actual * 4 / 1e6, 1), "depth": 3,
             "largest_tensor_MB": round(largest / 1e6, 1), **r}
        rows.append(r)
    base = rows[0]
    for r in rows:
        if r is base:
            continue
        if r["aggregator_rss_MB"] and base["aggregator_rss_MB"]:
            d_mem = r["aggregator_rss_MB"] - base["aggregator_rss_MB"]
            d_par = r["param_MB"] - base["param_MB"]
            r["aggregator_rss_per_param_byte"] = round(d_mem / d_par, 2) if d_par else None
    base.pop("aggregator_rss_per_param_byte", None)
    return rows


def alloc_check(sizes_mb: tuple[int, ...] = (4, 16, 64), reps: int = 10) -> dict[str, Any]:
    """What a fresh per-step copy costs against a copy into a reused buffer (in this process, 1 thread).

    The aggregator clones the gradient sum and the published parameters every step, and the worker lets
    backward allocate fresh .grad tensors; big fresh allocations come from new mmap()s whose pages are
    faulted in (and zeroed by the kernel) on first touch, every step.
    """
    import resource

    import torch

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    out = {}
    for mb in sizes_mb:
        src = torch.randn((mb << 20) // 4)
        buf = torch.empty_like(src)
        buf.copy_(src)
        row = {}
        for name in ("fresh_clone", "reused_buffer"):
            f0, t0 = faults(), time.process_time()
            for _ in range(reps):
                if name == "fresh_clone":
                    x = src.clone()
                    del x
                else:
                    buf.copy_(src)
            row[f"{name}_ms"] = round((time.process_time() - t0) / reps * 1e3, 2)
            row[f"{name}_faults"] = round((faults() - f0) / reps)
        row["ratio"] = C.ratio(row["fresh_clone_ms"], row["reused_buffer_ms"])
        out[f"{mb}MiB"] = row
    return out


def worker_sweep(work: Path, wl_name: str, workers: list[int], steps: int) -> list[dict[str, Any]]:
    wl = dict(WORKLOADS[wl_name])
    M = 6
    wl["global_batch"] = max(M, (wl["global_batch"] // M) * M) if wl_name == "comm_bound" else 48
    rows = []
    for n in workers:
        C.log(f"{wl_name}: {n} workers, M={M}, global batch {wl['global_batch']}, {steps} steps")
        r = measured_run(work, f"scale_{wl_name}_{n}w", wl, steps, n, M)
        rows.append({"workers": n, "global_batch": wl["global_batch"], "microbatches": M, **r})
    t1 = rows[0]["step_time_median_s"]
    for r in rows:
        r["speedup_vs_1w"] = C.ratio(t1, r["step_time_median_s"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--params", default=None)
    p.add_argument("--workers", default="1,2,3")
    p.add_argument("--worker-workloads", default=None)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    C.setup(threads=1)
    sizes = [int(float(x)) for x in (args.params or ("1e6,16e6" if args.quick else "1e6,4e6,16e6,64e6")).split(",")]
    workers = [int(x) for x in args.workers.split(",")]
    wls = (args.worker_workloads or ("compute_bound" if args.quick else "compute_bound,comm_bound")).split(",")
    work = C.workdir("scaling")
    result: dict[str, Any] = {"bench": "scaling", **C.provenance(), "machine": C.machine(), "quick": args.quick}
    t_start = time.monotonic()
    try:
        result["by_params"] = param_sweep(work, sizes, 20 if args.quick else 40)
        result["fresh_vs_reused_copy"] = alloc_check()
        result["by_workers"] = {wl: worker_sweep(work, wl, workers, 12 if args.quick else 25) for wl in wls}
        bp = result["by_params"]
        result["summary"] = {
            "step_time_s_by_param_MB": {str(r["param_MB"]): r["step_time_median_s"] for r in bp},
            "aggregator_hwm_MB_by_param_MB": {str(r["param_MB"]): r["aggregator_hwm_MB"] for r in bp},
            "aggregator_MB_per_param_MB": {str(r["param_MB"]): r.get("aggregator_rss_per_param_byte") for r in bp[1:]},
            "minor_page_faults_per_step_by_param_MB": {str(r["param_MB"]): r["minor_page_faults_per_step"] for r in bp},
            "fresh_vs_reused_copy_64MiB_ms": [result["fresh_vs_reused_copy"]["64MiB"]["fresh_clone_ms"],
                                              result["fresh_vs_reused_copy"]["64MiB"]["reused_buffer_ms"]],
            "speedup_by_workers": {wl: {str(r["workers"]): r["speedup_vs_1w"] for r in rows}
                                   for wl, rows in result["by_workers"].items()},
        }
        result["notes"] = [
            f"{C.machine()['cpus']} shared CPU cores: with N workers, N + 1 busy processes (workers + aggregator) share "
            "them, so more than 1-2 workers cannot speed up here; the numbers show the trend and the contention",
            "aggregator memory per parameter byte (above the smallest model): parameters, optimizer state (SGD momentum), "
            "the gradient sum, the published copy sent to workers, and received gradient frames",
            "param sweep: 1 worker, global batch 16, M=1: the step is dominated by moving and applying parameters",
            "worker sweep: train.microbatches=6 for every worker count",
            "minor_page_faults_per_step: page faults of the aggregator / worker per training step (4 KiB each): memory "
            "freshly allocated and touched every step (the gradient sum's clone, the published parameter copy, new .grad "
            "tensors, received frames); fresh_vs_reused_copy shows what that costs per copy on this machine",
        ]
    except BaseException as exc:
        C.record_error(result, exc)
        raise
    finally:
        C.finish(result, work, args.keep, t_start)


if __name__ == "__main__":
    main()
