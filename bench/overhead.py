"""Overhead of CMEMI against plain PyTorch and torchrun DDP, on the same model, batch and step count.

For a compute-bound model (a small CNN) and a communication-bound one (a wide MLP on tiny batches):
  (a) a plain single-process PyTorch loop            bench/torch_train.py
  (b) CMEMI with 1 worker  (train.microbatches = 1)   cmemi up, metrics.jsonl step_time_s
  (c) CMEMI with 2 workers (train.microbatches = 2)
  (d) torchrun DDP (gloo), 2 processes                python -m torch.distributed.run --nproc_per_node 2 ...
  (e) CMEMI with 2 workers and 2 parameter-server shards (cluster.shards = 2)
  (f) CMEMI with 2 workers over tcp:// and `security.curve: false` (what CurveZMQ costs: gloo encrypts nothing)
  (g) CMEMI with 2 workers over CurveZMQ tcp:// (`cluster.transport: tcp`); (c) takes the default, `auto`: the
      workers share the aggregator's host, so they reach it over ipc:// and their tensors travel in shared-memory
      slots (shared/wire/samehost.py, shared/memory/shm.py)
  (h), (i) as (f) and (g) with 1 worker: (b) against tcp:// without Curve and CurveZMQ tcp://, one row per transport
Each CMEMI row also reports `socket_bytes_per_grad_byte`: the bytes the aggregator received through its socket per
byte of gradient the workers produced (about 1 with frames, about 0 with slots, where only descriptors go).
Every process runs one intra-op thread. M equals the worker count so each process computes exactly the
forward/backward its baseline counterpart does (global batch B: plain and 1 worker compute B per step,
DDP ranks and CMEMI's 2 workers B/2 each).

    .venv/bin/python bench/overhead.py [--quick] [--repeats R]

Prints one JSON object; `ratios.<workload>.cmemi_1w_vs_plain` = (b)/(a) and `cmemi_2w_vs_ddp_2p` = (c)/(d)
and `cmemi_2w_k2_vs_ddp_2p` = (e)/(d), `cmemi_2w_nocurve_vs_ddp_2p` = (f)/(d), `cmemi_2w_tcp_vs_ddp_2p` = (g)/(d),
`cmemi_1w_nocurve_vs_plain` = (h)/(a), `cmemi_1w_tcp_vs_plain` = (i)/(a) (step-time ratios, lower is better). Runs in the same invocation alternate so that slow drift of the
shared machine's load affects all variants alike; with --repeats > 1 the medians over repeats are used.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench.models import WORKLOADS  # noqa: E402

SCRIPT = C.ROOT / "bench" / "torch_train.py"
# every variant after (a), in the order each repeat runs them: cmemi's arguments, or None for DDP
VARIANTS: dict[str, dict[str, Any] | None] = {
    "cmemi_1w": {"workers": 1},
    "ddp_2p": None,
    "cmemi_2w": {"workers": 2},
    "cmemi_2w_k2": {"workers": 2, "shards": 2},
    "cmemi_2w_nocurve": {"workers": 2, "curve": False, "transport": "tcp"},
    "cmemi_2w_tcp": {"workers": 2, "transport": "tcp"},
    "cmemi_1w_nocurve": {"workers": 1, "curve": False, "transport": "tcp"},
    "cmemi_1w_tcp": {"workers": 1, "transport": "tcp"},
}


def plain(work: Path, wl: str, steps: int, warmup: int, tag: str) -> dict[str, Any]:
    out = work / f"plain-{tag}.json"
    rc = C.run_checked([C.PY, str(SCRIPT), "--workload", wl, "--steps", str(steps), "--warmup", str(warmup),
                        "--out", str(out)], timeout=600, log_path=work / f"plain-{tag}.log")
    if rc != 0:
        raise RuntimeError(f"plain loop failed ({rc}); see {work / f'plain-{tag}.log'}")
    r = json.loads(out.read_text())
    return {k: r[k] for k in ("step_time_median_s", "wall_per_step_s", "cpu_s_per_step")}


def ddp(work: Path, wl: str, steps: int, warmup: int, tag: str, nproc: int = 2, attempts: int = 4) -> dict[str, Any]:
    """torchrun --standalone now and then fails to start its group here (1 run in ~20, twice in a row once); up to
    three retries, counted."""
    out = work / f"ddp-{tag}.json"
    argv = [C.PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(SCRIPT),
            "--workload", wl, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    for attempt in range(1, attempts + 1):
        log_path = work / f"ddp-{tag}-{attempt}.log"
        rc = C.run_checked(argv, timeout=600, log_path=log_path)
        if rc == 0:
            break
        C.log(f"torchrun failed ({rc}), attempt {attempt}/{attempts}; last lines of {log_path}:\n"
              + "\n".join(log_path.read_text(errors="replace").splitlines()[-8:]))
    else:
        raise RuntimeError(f"torchrun failed {attempts} times ({rc}); see {log_path}")
    r = json.loads(out.read_text())
    return {**{k: r[k] for k in ("step_time_median_s", "wall_per_step_s", "cpu_s_per_step")}, "attempts": attempt}


def cmemi(work: Path, wl: str, steps: int, warmup: int, workers: int, tag: str, shards: int = 1,
          curve: bool = True, transport: str = "auto") -> dict[str, Any]:
    name = C.safe_name(f"ovh_{tag}")
    cfg = C.cmemi_config(name, work / name, WORKLOADS[wl], steps=steps, microbatches=workers, workers=workers,
                         shards=shards)
    cfg["security"] = {"curve": curve}
    cfg["cluster"]["transport"] = transport
    t0 = time.time()
    with C.CmemiRun(cfg, work) as run:
        cpu = C.GroupCpu(run.group.pgid)
        deadline = time.monotonic() + 600
        while run.group.alive and time.monotonic() < deadline:
            step = run.step() if (run.run_dir / "cluster.json").exists() else 0
            if warmup < step < steps:  # the measured steps only (not start-up, final eval and checkpoint)
                cpu.sample(step)
            time.sleep(0.2)
        rc = run.wait(timeout=max(1.0, deadline - time.monotonic()))
        if rc != 0:
            raise RuntimeError(f"cmemi up failed ({rc}); see {run.log_path}:\n{run.group.tail()}")
        stats = C.step_stats(run.metrics(), warmup)
        summ = run.summary() or {}
    stats["summary_wall_per_step_s"] = summ["wall_s"] / summ["steps"] if summ.get("steps") else None
    stats["startup_and_teardown_s"] = round(time.time() - t0 - (summ.get("wall_s") or 0), 1)
    stats["cpu"] = cpu.per_unit()  # CPU seconds per step of every process of the cluster
    stats["cpu_s_per_step"] = stats["cpu"].get("cpu_s_per_unit")
    stats["bytes_received"], stats["steps_run"] = summ.get("bytes_received"), summ.get("steps")
    stats["bytes_received_via_slots"] = summ.get("bytes_received_via_slots", 0)
    return stats


def socket_share(runs: list[dict[str, Any]], workers: int, grad_bytes: int) -> float | None:
    """Bytes the aggregator received through its socket per gradient byte (each worker sends one per step)."""
    vals = [(r["bytes_received"] - r.get("bytes_received_via_slots", 0)) / (r["steps_run"] * workers * grad_bytes)
            for r in runs if r.get("bytes_received") is not None and r.get("steps_run")]
    return round(C.median(vals), 4) if vals else None


def copy_floor(nbytes: int, copies: int, reps: int = 15) -> dict[str, Any]:
    """What `copies` memory copies of `nbytes` each cost here (torch `copy_` between two buffers, one thread), warm
    (the source just written) and cold (64 MiB touched in between): the floor under a step that must copy that
    much, measured in the same run as the steps."""
    import torch

    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    evict = torch.empty(16 << 20)
    out: dict[str, Any] = {"bytes_per_copy": nbytes, "copies_per_step": copies}
    for kind in ("warm", "cold"):
        times = []
        for _ in range(reps):
            if kind == "warm":
                src.add_(0.0)
            else:
                evict.fill_(1.0)
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        s = C.median(times)
        out[f"{kind}_GB_per_s"] = round(nbytes / s / 1e9, 2)
        out[f"{kind}_ms_per_step"] = round(copies * s * 1e3, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (for make bench)")
    p.add_argument("--repeats", type=int, default=None,
                   help="repeat every variant R times (medians over repeats); default 3, quick 1")
    p.add_argument("--steps-compute", type=int, default=None)
    p.add_argument("--steps-comm", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--workloads", default="compute_bound,comm_bound")
    p.add_argument("--keep", action="store_true", help="keep the working directory (logs, run dirs)")
    p.add_argument("--variants", default=None,
                   help="run only these CMEMI/DDP variants, comma-separated (e.g. cmemi_1w,cmemi_1w_nocurve; plain "
                        "always runs): a quick direction check, not the figures")
    args = p.parse_args()
    C.setup(threads=1)
    steps = {"compute_bound": args.steps_compute or (20 if args.quick else 40),
             "comm_bound": args.steps_comm or (40 if args.quick else 100)}
    repeats = {"compute_bound": args.repeats or (1 if args.quick else 3),
               "comm_bound": args.repeats or (1 if args.quick else 3)}
    chosen = set(args.variants.split(",")) if args.variants else set()
    work = C.workdir("overhead")
    result: dict[str, Any] = {"bench": "overhead", **C.provenance(), "machine": C.machine(), "quick": args.quick, "workdir": str(work)}
    t_start = time.monotonic()
    try:
        results: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for wl in args.workloads.split(","):
            n = steps[wl]
            if unknown := sorted(chosen - set(VARIANTS)):
                raise SystemExit(f"--variants: no variant {unknown}; choose from {', '.join(VARIANTS)}")
            results[wl] = {"plain": [], **{k: [] for k in VARIANTS}}
            for r in range(repeats[wl]):
                tag = f"{wl}-{r}"
                C.log(f"{wl} repeat {r}: plain ({n} steps)")
                results[wl]["plain"].append(plain(work, wl, n, args.warmup, tag))
                C.log(f"{wl}: plain -> {results[wl]['plain'][-1]['step_time_median_s']:.4f}s")
                for key, spec in VARIANTS.items():
                    if chosen and key not in chosen:
                        continue
                    results[wl][key].append(ddp(work, wl, n, args.warmup, tag) if spec is None else
                                            cmemi(work, wl, n, args.warmup, tag=f"{tag}-{key}", **spec))
                    C.log(f"{wl}: {key} -> {results[wl][key][-1].get('step_time_median_s')}")
        step_times: dict[str, Any] = {}
        ratios: dict[str, Any] = {}
        for wl, by in results.items():
            med = {k: C.median(x.get("step_time_median_s") for x in v) for k, v in by.items()}
            wall = {k: C.median(x.get("wall_per_step_s") for x in v) for k, v in by.items()}
            cpu = {k: C.median(x.get("cpu_s_per_step") for x in v) for k, v in by.items()}
            step_times[wl] = {
                "steps": steps[wl], "repeats": repeats[wl], "warmup_skipped": args.warmup, "workload": WORKLOADS[wl],
                "median_step_time_s": C.rnd(med, 5), "wall_per_step_s": C.rnd(wall, 5),
                "cpu_s_per_step": C.rnd(cpu, 5),
                "runs": C.rnd(by, 5),
            }
            ratios[wl] = {
                "cmemi_1w_vs_plain": C.ratio(med["cmemi_1w"], med["plain"]),
                "cmemi_2w_vs_ddp_2p": C.ratio(med["cmemi_2w"], med["ddp_2p"]),
                "cmemi_2w_k2_vs_ddp_2p": C.ratio(med["cmemi_2w_k2"], med["ddp_2p"]),
                "cmemi_2w_nocurve_vs_ddp_2p": C.ratio(med["cmemi_2w_nocurve"], med["ddp_2p"]),
                "cmemi_2w_tcp_vs_ddp_2p": C.ratio(med["cmemi_2w_tcp"], med["ddp_2p"]),
                "cmemi_1w_nocurve_vs_plain": C.ratio(med["cmemi_1w_nocurve"], med["plain"]),
                "cmemi_1w_tcp_vs_plain": C.ratio(med["cmemi_1w_tcp"], med["plain"]),
                "wall_cross_check": {"cmemi_1w_vs_plain": C.ratio(wall["cmemi_1w"], wall["plain"]),
                                     "cmemi_2w_vs_ddp_2p": C.ratio(wall["cmemi_2w"], wall["ddp_2p"])},
                "cpu_cost": {"cmemi_1w_vs_plain": C.ratio(cpu["cmemi_1w"], cpu["plain"]),
                             "cmemi_2w_vs_ddp_2p": C.ratio(cpu["cmemi_2w"], cpu["ddp_2p"])},
                "speedup_2w_over_1w": {"cmemi": C.ratio(med["cmemi_1w"], med["cmemi_2w"]),
                                       "ddp_vs_plain": C.ratio(med["plain"], med["ddp_2p"])},
            }
        from cmemi.shared.config.lookup import resolve

        from bench.models import count_params

        result["model_params"] = {wl: count_params(resolve(WORKLOADS[wl]["model"]["factory"], "m")(
            **WORKLOADS[wl]["model"]["kwargs"])) for wl in results}
        for wl, by in results.items():  # float32 gradients: 4 bytes per parameter
            step_times[wl]["socket_bytes_per_grad_byte"] = {
                k: socket_share(v, 2 if "_2w" in k else 1, 4 * result["model_params"][wl])
                for k, v in by.items() if k.startswith("cmemi") and "_k2" not in k}
        result["ratios"] = ratios
        result["step_times"] = step_times
        if "comm_bound" in step_times:  # over slots a step copies a gradient into the worker's slot and a version into
            # the leader's (read in place on the other side): two copies of the parameters' bytes at least
            med = step_times["comm_bound"]["median_step_time_s"]
            floor = copy_floor(4 * result["model_params"]["comm_bound"], 2)
            floor["cmemi_1w_over_plain_ms"] = round((med["cmemi_1w"] - med["plain"]) * 1e3, 2)
            result["copy_floor"] = {"comm_bound": floor}
        cb = ratios.get("compute_bound", {})
        result["targets"] = {
            "compute_bound_cmemi_1w_vs_plain_le_1.10": (cb.get("cmemi_1w_vs_plain") or 99) <= 1.10,
            "compute_bound_cmemi_2w_vs_ddp_2p_le_1.00": (cb.get("cmemi_2w_vs_ddp_2p") or 99) <= 1.00,
            "comm_bound_cmemi_2w_k2_vs_ddp_2p_le_1.00":
                (ratios.get("comm_bound", {}).get("cmemi_2w_k2_vs_ddp_2p") or 99) <= 1.00,
            "comm_bound_cmemi_2w_vs_ddp_2p_le_1.00": (ratios.get("comm_bound", {}).get("cmemi_2w_vs_ddp_2p") or 99) <= 1.00,
            "comm_bound_cmemi_1w_vs_plain_le_2.00": (ratios.get("comm_bound", {}).get("cmemi_1w_vs_plain") or 99) <= 2.00,
        }
        result["notes"] = [
            f"{C.machine()['cpus']} CPU cores, shared with other jobs: CMEMI with 2 workers runs 3 busy processes "
            "(2 workers + the aggregator, plus coordinator/checkpointer/Redis mostly idle) on 2 cores, DDP 2 processes; "
            "so (c)/(d) includes CPU contention that separate hosts would not have",
            "every process uses 1 intra-op thread (OMP_NUM_THREADS=1, torch.set_num_threads(1), "
            "cluster.threads_per_worker=1)",
            "CMEMI step times: median of metrics.jsonl step_time_s after the warm-up steps; wall_per_step_s is the "
            "cross-check from the metrics' wall-clock timestamps over the same steps",
            "train.microbatches = number of workers (1 or 2) so per-process compute equals the baselines'",
            "CMEMI runs exclude process start-up (startup_and_teardown_s per run), like the baselines' step times",
            "cpu_s_per_step: CPU seconds per step summed over all processes of the variant (for CMEMI: every process of "
            "the cluster, Redis included); less sensitive to the shared machine's load than wall time",
            "copies per byte, by the code paths (not measured): with slots (`auto`, same host) a gradient byte is "
            "copied into the worker's slot (1) and read there by the server (summed into a waiting partial sum, or "
            "copied once into a kept buffer; at M = 1 stepped where it lies), a parameter byte once into the server's "
            "slot for all W same-host workers, read there in place by each (services/worker/links/lending.py: 1/W; 1/W + 1 "
            "for a model whose forward pass writes its parameters), and only descriptors cross the socket; with frames (tcp://, ipc:// before slots) each byte crosses the socket (kernel copies on both "
            "sides) and is checksummed on each side; parameters go out from the live tensors (copy-on-write) for a "
            "model over 16 MiB, through the publisher's flat copy for a smaller one; CurveZMQ adds encryption and "
            "its buffers on both sides",
        ]
    except BaseException as exc:
        C.record_error(result, exc)
        raise
    finally:
        C.finish(result, work, args.keep, t_start)


if __name__ == "__main__":
    main()
