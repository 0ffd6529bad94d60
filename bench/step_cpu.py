"""The small-step floor in CPU time: milliseconds of CPU each process (and each thread) spends per training step.

Issue 45 ("the hot path is no slower"): a millisecond step is where per-step overhead shows, and on a shared
2-core machine its wall-clock time moves with everyone else's load (the same commit measured 6.3 and 7.9 ms per
step two minutes apart at a load average of 6-7), while the CPU a process spends per step moves far less. This
runs the CNN of bench/small.py (`cnn1d`, 2 workers, 4 microbatches, Adam, the `cmemi_2w` row) in one or more
checkouts, alternating, and reads /proc/PID/task/TID/schedstat (on-CPU nanoseconds) of every thread of every process of the cluster
between step `--warmup` and the last steps: CPU ms per step by role (`worker` sums both workers) and by thread
(`main`, the ZeroMQ I/O thread `ZMQbg/IO/0`, `python` for the service's own threads), the wall ms per step from
metrics.jsonl, and each run's params_sha256 (the same bits in every variant of the same code).

    .venv/bin/python bench/step_cpu.py --tree base=/work/wt/base-e3f --tree head=. \\
        --tree nolog=.,checkpoint.step_log=false [--steps 400] [--repeats 3]

A `--tree NAME=PATH[,SECTION.KEY=VALUE...]` is a checkout with its own .venv (its code is what runs) and config
values set on top of the workload's; the first tree is the one every other is divided by (`ratios`). Prints one
JSON object (`median.<tree>.cpu_ms_per_step_total`, `ratios.<tree>`); lower is better.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench.small import BATCH, DATA, LR, MICROBATCHES, WORKLOADS  # noqa: E402

ROLES = ("aggregator", "worker", "checkpointer", "coordinator", "redis", "up", "zygote")
TAIL = 10  # the last steps are left out: the run's end (final checkpoint, summary) is not a step's cost


def parse_tree(spec: str) -> dict[str, Any]:
    """"head=.,checkpoint.step_log=false" -> {"name": "head", "path": "/abs/.", "set": {"checkpoint": {...}}}."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"--tree {spec!r}: expected NAME=PATH[,SECTION.KEY=VALUE...], e.g. head=.")
    path, *sets = rest.split(",")
    root = Path(path).resolve()
    if not (root / ".venv" / "bin" / "python").exists():
        raise SystemExit(f"--tree {spec!r}: {root}/.venv/bin/python does not exist; give a checkout with its venv")
    overrides: dict[str, dict[str, Any]] = {}
    for s in sets:
        key, eq, value = s.partition("=")
        section, dot, field = key.partition(".")
        if not eq or not dot:
            raise SystemExit(f"--tree {spec!r}: {s!r} is not SECTION.KEY=VALUE, e.g. checkpoint.step_log=false")
        overrides.setdefault(section, {})[field] = yaml.safe_load(value)
    return {"name": name, "path": str(root), "set": overrides}


def config(name: str, run_dir: Path, steps: int, overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """bench/small.py's cnn1d `cmemi_2w` run, with `overrides` set on top."""
    cfg: dict[str, Any] = {
        "run": {"name": name, "dir": str(run_dir), "seed": 0},
        "model": {"factory": WORKLOADS["cnn1d"]}, "data": {"factory": DATA["cnn1d"], "workers": 0},
        "optimizer": {"name": "Adam", "kwargs": {"lr": LR}},
        "train": {"steps": steps, "global_batch": BATCH, "microbatches": MICROBATCHES},
        "cluster": {"workers": 2, "spare_workers": 0}, "checkpoint": {"every_steps": 0}}
    for section, values in overrides.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid` so far: {"main" | thread name + "#" + tid: seconds}. From schedstat (ns:
    a 10 ms clock tick is as long as a step here), else from stat's utime + stime."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        task = f"/proc/{pid}/task/{tid}"
        try:
            stat = Path(f"{task}/stat").read_text()
            name = "main" if tid == str(pid) else stat[stat.index("(") + 1:stat.rindex(")")]
            try:
                cpu = int(Path(f"{task}/schedstat").read_text().split()[0]) / 1e9
            except (OSError, IndexError, ValueError):
                fields = stat.rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError):
            continue
        out[f"{name}#{tid}"] = cpu
    return out


def role(label: str) -> str:
    return "worker" if label.startswith("worker") else label


def per_step(first: dict[int, dict[str, float]], last: dict[int, dict[str, float]], labels: dict[int, str],
             steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """(CPU ms per step by role, by role/thread name) between two samples `steps` steps apart."""
    by_role: dict[str, float] = {}
    by_thread: dict[str, float] = {}
    for pid, threads in last.items():
        r = role(labels[pid])
        for key, cpu in threads.items():
            ms = 1000 * (cpu - first[pid].get(key, 0.0)) / steps
            by_role[r] = by_role.get(r, 0.0) + ms
            t = f"{r}/{key.split('#')[0]}"
            by_thread[t] = by_thread.get(t, 0.0) + ms
    return ({k: round(v, 3) for k, v in sorted(by_role.items())},
            {k: round(v, 3) for k, v in sorted(by_thread.items()) if v >= 0.005})


def run_once(tree: dict[str, Any], work: Path, steps: int, warmup: int, tag: str) -> dict[str, Any]:
    """One `cmemi up` of `tree`'s code; CPU sampled from step `warmup` until `steps - TAIL`."""
    name = C.safe_name(f"stepcpu_{tree['name']}_{tag}")
    run_dir = work / name
    cfg_path = C.write_yaml(work / f"{name}.yaml", config(name, run_dir, steps, tree["set"]))
    root = Path(tree["path"])
    env = C.env(PYTHONPATH=str(root))
    group = C.ProcGroup([str(root / ".venv" / "bin" / "python"), "-m", "cmemi", "up", str(cfg_path), "--overwrite"],
                        work / f"{name}.log", env_=env, cwd=root)
    tail = C.JsonlTail(run_dir / "metrics.jsonl")
    first: dict[int, dict[str, float]] = {}
    last: dict[int, dict[str, float]] = {}
    labels: dict[int, str] = {}
    s0 = s1 = 0
    deadline = time.monotonic() + 900
    try:
        while group.alive and time.monotonic() < deadline:
            rows = tail.read()
            step = rows[-1]["step"] if rows else 0
            if step >= steps - TAIL:
                break
            if step >= warmup:
                if not first:
                    labels = C.group_pids(group.pgid)
                    first = {pid: thread_cpu(pid) for pid in labels}
                    s0 = step
                last = {pid: thread_cpu(pid) for pid in labels}
                s1 = step
            time.sleep(0.01)  # a sample per 10 ms: a step or two apart
        rc = group.wait(600)
    finally:
        group.stop(grace=20)
    if rc != 0 or s1 <= s0:
        raise RuntimeError(f"{tree['name']}: cmemi up failed ({rc}) or sampled no steps; see {work / name}.log:\n"
                           f"{group.tail()}")
    by_role, by_thread = per_step(first, last, labels, s1 - s0)
    rows = tail.read()
    t0 = next(r for r in rows if r["step"] == warmup)["t"]
    measured = [r for r in rows if r["step"] > warmup]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"ms_per_step": round(1000 * (measured[-1]["t"] - t0) / len(measured), 3),
            "cpu_ms_per_step_total": round(sum(by_role.values()), 3), "cpu_ms_per_step": by_role,
            "cpu_ms_per_step_by_thread": by_thread, "steps_sampled": s1 - s0,
            "params_sha256": summary.get("params_sha256"), "load_avg": C.load_avg()}


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: C.rnd(C.median(r[k] for r in runs), 3) for k in ("ms_per_step", "cpu_ms_per_step_total")}
    for key in ("cpu_ms_per_step", "cpu_ms_per_step_by_thread"):
        names = sorted({n for r in runs for n in r[key]})
        out[key] = {n: C.rnd(C.median(r[key].get(n, 0.0) for r in runs), 3) for n in names}
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", default=None,
                   help="NAME=PATH[,SECTION.KEY=VALUE...], repeatable; the first is the base (default: head=.)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    if args.steps < args.warmup + TAIL + 20:
        raise SystemExit(f"--steps {args.steps}: give at least --warmup + {TAIL + 20} ({args.warmup + TAIL + 20})")
    trees = [parse_tree(s) for s in (args.tree or ["head=."])]
    if len({t["name"] for t in trees}) != len(trees):
        raise SystemExit("--tree: every NAME once")
    C.setup()
    t_start = time.monotonic()
    work = C.workdir("step-cpu", args.keep)
    result: dict[str, Any] = {
        "bench": "step_cpu", **C.provenance(), "machine": C.machine(), "command": " ".join(
            [".venv/bin/python", "bench/step_cpu.py", *(a for a in argv if a != "--out" and not a.endswith(".json"))]),
        "workload": "bench/small.py cnn1d cmemi_2w", "steps": args.steps, "warmup": args.warmup,
        "repeats": args.repeats, "trees": {t["name"]: {**t, **C.provenance(Path(t["path"]))} for t in trees},
        "runs": {t["name"]: [] for t in trees}}
    try:
        for r in range(args.repeats):
            for t in trees:  # alternating: the machine's drift falls on every tree alike
                run = run_once(t, work, args.steps, args.warmup, f"r{r}")
                result["runs"][t["name"]].append(run)
                C.log(f"{t['name']} r{r}: {run['cpu_ms_per_step_total']} CPU ms/step {run['cpu_ms_per_step']}, "
                      f"wall {run['ms_per_step']} ms/step, load {run['load_avg'][0]}")
        result["median"] = {name: medians(runs) for name, runs in result["runs"].items()}
        base = result["median"][trees[0]["name"]]
        result["ratios"] = {name: {f"{k}_vs_{trees[0]['name']}": C.ratio(m[k], base[k])
                                   for k in ("cpu_ms_per_step_total", "ms_per_step")}
                            for name, m in result["median"].items()}
        result["params_sha256"] = {name: sorted({r["params_sha256"] for r in runs})
                                   for name, runs in result["runs"].items()}
    except BaseException as exc:
        C.record_error(result, exc)
    C.finish(result, work, args.keep, t_start)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
