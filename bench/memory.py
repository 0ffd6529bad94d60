"""Peak memory of every process of a cluster training a big plain MLP, per role, against its budget and
against two DDP ranks of the same model measured in the same run (issue 34).

The workload: a wide MLP of about 113 M parameters (453 MB of fp32; `bench.models:mlp`, 1024 inputs, 4 hidden
layers of ~5,970), Adam, 2 workers (train.microbatches = 2), no spare, a small batch (8) so steps are cheap, a
checkpoint every 10 steps and 25 steps (checkpoints at 10 and 20, then the final one), at cluster.shards
K = 1, 2, 4. Every process of the cluster (`cmemi up`, its Redis, the zygote, the coordinator, the leader
(shard 0), shards 1..K-1, each worker, the checkpointer) is sampled every 0.1 s for its peak RSS (VmHWM,
/proc/PID/status) until it exits; roles come from the Redis member records (PIDs). Then two DDP ranks (torchrun,
gloo, the same model, Adam, global batch and checkpoint cadence; rank 0 torch.saves model + optimizer state)
report their own VmHWM at exit. "Interpreter" is the VmHWM of a plain `python` that imports what the zygote
preloads for every service (cmemi/launcher/zygote.py: PRELOAD) and the model's module, measured in the same run.

The budgets (issue 34's goals; `budgets()` below is the one place they are written, tests/test_memory_budget.py
checks the same ones on a smaller model):
- each shard (the leader is shard 0): 1.5 × (its slice + its optimizer state + one gradient sum) + interpreter,
  slices from shared/core/grid.py's Partition (the real piece assignment);
- each worker: 1.3 × (parameters + gradients) + interpreter;
- the checkpointer: interpreter + 2 × the transfer cap (cluster.max_message_bytes; null: 64 MiB at this size);
- the whole cluster (the sum of every process's peak, `cmemi up`, Redis and the zygote included):
  1.5 × the two DDP ranks' peaks summed.
The step log is on (checkpoint.step_log, the default) and adds nothing to these budgets (issue 47): a server stages
each entry in one shared-memory slot of a slice (services/aggregator/steplog/staging.py), and the checkpointer writes
a same-host entry into its spool a chunk at a time straight from that slot, holding none of it
(services/checkpointer/steplog.py `Streamed`); docs/memory_accounting.md says where each role's bytes go.

    .venv/bin/python bench/memory.py [--quick] [--shards 1,2,4] [--steps 25] [--scale 4] [--out FILE]

Prints one JSON object (and writes it to --out). `--quick`: K = 1, 2 and 12 steps with a checkpoint every 5.
`--scale 4` adds a model of 4× the parameters where the machine's memory allows (else the reason is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402

MB = 1e6
SHARD_FACTOR, WORKER_FACTOR, CLUSTER_FACTOR = 1.5, 1.3, 1.5  # the multiples
OPTIMIZER_STATE = {"Adam": 2, "AdamW": 2, "SGD": 1}  # parameter-sized optimizer tensors per parameter (SGD: momentum)
POLL_S = 0.1
WARMUP = 3
FAULT_EVENTS = ("died", "exited", "fenced", "restarted", "gave_up")  # events.jsonl: a process replaced mid-run


# ---------------------------------------------------------------------------------------- the workload
def workload(params: float = 113e6, in_dim: int = 1024, depth: int = 5, batch: int = 8) -> dict[str, Any]:
    """The plain wide MLP of issue 34 (about `params` parameters) with synthetic data and Adam."""
    from bench.models import hidden_for_params

    hidden = hidden_for_params(int(params), in_dim, depth)
    return {"model": {"factory": "bench.models:mlp", "kwargs": {"in_dim": in_dim, "hidden": hidden, "depth": depth}},
            "data": {"factory": "bench.models:synthetic", "kwargs": {"n": 256, "shape": [in_dim]}},
            "global_batch": batch, "lr": 1e-4, "optimizer": "Adam"}


def model_facts(wl: dict[str, Any], shards: int) -> dict[str, Any]:
    """Parameter count and bytes, and each shard's slice in bytes from the real piece assignment (on the meta
    device: nothing allocated)."""
    import torch
    from cmemi.shared.config.lookup import resolve
    from cmemi.shared.core.grid import Partition

    with torch.device("meta"):
        model = resolve(wl["model"]["factory"], "model")(**wl["model"]["kwargs"])
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    part = Partition(params, shards)
    return {"params": sum(p.numel() for p in params.values()),
            "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "slice_bytes": [part.bytes_of(k) for k in range(shards)]}


def transfer_cap(max_message_bytes: int | None, model_bytes: int) -> int:
    """cluster.max_message_bytes as the services derive it (shared/wire/limits.py) when the config leaves it null."""
    from cmemi.shared.wire.limits import DEFAULT_CAP, MARGIN

    return max_message_bytes if max_message_bytes else min(4 * model_bytes + MARGIN, DEFAULT_CAP)


# ---------------------------------------------------------------------------------------- the budgets
def budgets(param_bytes: int, slice_bytes: list[int], interpreter: int, cap: int,
            optimizer: str = "Adam") -> dict[str, int]:
    """Issue 34's peak-memory budget per role, in bytes: 'shard k' for each shard (k = 0 is the leader), 'worker'
    (each), 'checkpointer'. The same with the step log on: issue 47 asks every server to stay within them with it, and
    the term that once added the log's stated cost (the leader's staged copy, a shard's two, the checkpointer's
    in-memory log and landing buffer) is gone with most of the memory it stood for: the checkpointer holds a chunk of
    an entry at a time, and a server's one staged slot is the last of the six slices its 1.5 × (slice + Adam's two +
    a gradient sum) allows (its slice, Adam's two, the two gradient buffers kept from step to step, the slot), so a
    server peaks at its budget's edge (the leader at K = 1, measured on 24 M and 48 M parameters by hand: about 10 MB
    under it)."""
    state = OPTIMIZER_STATE[optimizer]
    out = {f"shard {k}": int(SHARD_FACTOR * (s + state * s + s) + interpreter) for k, s in enumerate(slice_bytes)}
    out["worker"] = int(WORKER_FACTOR * (2 * param_bytes) + interpreter)
    out["checkpointer"] = int(interpreter + 2 * cap)
    return out


def cluster_budget(ddp_ranks_bytes: int) -> int:
    return int(CLUSTER_FACTOR * ddp_ranks_bytes)


def budget_of(role: str, table: dict[str, int]) -> int | None:
    """The budget that applies to a process of `role` ('shard 1', 'worker w0', 'checkpointer'...); None: no budget
    (coordinator, zygote, Redis, `cmemi up`)."""
    if role.startswith("worker"):
        return table["worker"]
    return table.get(role)


def over_budget(roles: list[dict[str, Any]]) -> list[str]:
    """One line per process above its budget."""
    return [f"{r['role']}: peak {r['peak_MB']:.0f} MB > budget {r['budget_MB']:.0f} MB ({r['of_budget']:.2f}×)"
            for r in roles if r.get("within_budget") is False]


# ---------------------------------------------------------------------------------------- measuring
def interpreter_hwm() -> int:
    """VmHWM of a Python that imports what a service imports (the zygote's PRELOAD) and the bench's models."""
    code = ("import importlib, re; from cmemi.launcher.zygote import PRELOAD\n"
            "for m in PRELOAD: importlib.import_module(m)\n"
            "import bench.models\n"
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")
    out = subprocess.run([C.PY, "-c", code], cwd=C.ROOT, env=C.env(), capture_output=True, text=True, timeout=300,
                         check=True).stdout
    return int(out.split()[-1]) * 1024


class PeakSampler:
    """Every POLL_S, the VmHWM of every live process of a process group; the largest value seen per PID, with its
    label (bench/common.py: label) and parent PID as first seen."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.peak: dict[int, int] = {}
        self.label: dict[int, str] = {}
        self.parent: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(POLL_S)

    def sample(self) -> None:
        for pid, lab in C.group_pids(self.pgid).items():
            hwm = C.proc_status(pid).get("VmHWM")
            if not hwm:
                continue
            self.peak[pid] = max(self.peak.get(pid, 0), hwm)
            if pid not in self.label:
                self.label[pid] = lab
                try:
                    self.parent[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    self.parent[pid] = 0

    def roles(self, members: dict[int, str]) -> dict[int, str]:
        """PID -> role: the Redis member record's ('shard 1', 'worker w0', ...), else the command line's label;
        a process forked by a process of the same label that is no member itself (the checkpointer measuring the
        model in a child, the zygote checking the config in one) is '<role> (forked child)'."""
        out = {}
        for pid in self.peak:
            if pid in members:
                out[pid] = members[pid]
                continue
            parent = self.parent.get(pid, 0)
            if parent in self.peak and self.label.get(parent) == self.label[pid]:
                out[pid] = f"{members.get(parent, self.label[pid])} (forked child)"
            else:
                out[pid] = self.label[pid]
        return out


def member_pids(run: C.CmemiRun) -> dict[int, str]:
    """PID -> role of every member record in the run's Redis (running or not), e.g. 'shard 0', 'worker w1'."""
    out = {}
    for key in run.redis.scan_iter(match=run.keys.member("*", "*")):
        rec = run.redis.hgetall(key)
        if not rec.get("pid"):
            continue
        role = rec.get("role", "?")
        out[int(rec["pid"])] = (f"shard {rec['id']}" if role == "aggregator" else
                                f"worker {rec['id']}" if role == "worker" else role)
    return out


def cluster_run(work: Path, wl: dict[str, Any], *, shards: int, workers: int, steps: int, ckpt_every: int,
                interpreter: int, timeout: float = 1200, **cluster: Any) -> dict[str, Any]:
    """One `cmemi up` run; every process's peak RSS with its role and budget, step time and params_sha256."""
    facts = model_facts(wl, shards)
    name = f"mem_k{shards}_{facts['params'] // 1_000_000}m"
    cfg = C.cmemi_config(name, work / name, wl, steps=steps, microbatches=workers, workers=workers,
                         ckpt_every=ckpt_every, keep_last=2, shards=shards, **cluster)
    cfg["optimizer"] = {"name": wl["optimizer"], "kwargs": {"lr": wl["lr"]}}
    cap = transfer_cap(cfg["cluster"].get("max_message_bytes"), facts["param_bytes"] + facts["buffer_bytes"])
    log_on = cfg.get("checkpoint", {}).get("step_log", True)
    table = budgets(facts["param_bytes"], facts["slice_bytes"], interpreter, cap, wl["optimizer"])
    roles: dict[int, str] = {}
    t0 = time.monotonic()
    with C.CmemiRun(cfg, work) as run, PeakSampler(run.group.pgid) as sampler:
        deadline = time.monotonic() + timeout
        while run.group.alive and time.monotonic() < deadline:
            if (run.run_dir / "cluster.json").exists():
                try:
                    roles.update(member_pids(run))
                except Exception:  # Redis not up yet, or already gone at the end
                    pass
            time.sleep(0.5)
        rc = run.wait(timeout=max(1.0, deadline - time.monotonic()))
        sampler.sample()
        if rc != 0:
            raise RuntimeError(f"cmemi up failed ({rc}); see {run.log_path}:\n{run.group.tail()}")
        metrics, summ = run.metrics(), run.summary() or {}
        events = run.events()
    saved = [e["step"] for e in events if e["kind"] == "checkpoint_saved"]
    t_run = events[0]["t"] if events else 0.0
    faults = [{"kind": e["kind"], "role": e.get("role"), "id": e.get("id"), "how": e.get("how"),
               "t_s": round(e["t"] - t_run, 1), "after_step": max((m["step"] for m in metrics if m["t"] <= e["t"]), default=0)}
              for e in events if e["kind"] in FAULT_EVENTS]
    wall = time.monotonic() - t0
    named = sampler.roles(roles)
    procs, slots = [], {}
    for pid, peak in sampler.peak.items():
        role = named[pid]
        b = budget_of(role.removesuffix(" (forked child)"), table)
        row = {"role": role, "pid": pid, "peak_MB": round(peak / MB, 1),
               "x_param_bytes": round(peak / facts["param_bytes"], 2),
               "net_x_param_bytes": round((peak - interpreter) / facts["param_bytes"], 2)}
        if b is not None:
            row.update(budget_MB=round(b / MB, 1), of_budget=round(peak / b, 2), within_budget=peak <= b)
        procs.append(row)
        # a member's incarnations follow one another: the slot counts once, at its largest; anything else adds
        slot = role if pid in roles else f"pid {pid}"
        slots[slot] = max(slots.get(slot, 0), peak)
    procs.sort(key=lambda r: (_order(r["role"]), r["pid"]))
    total = sum(slots.values())
    restarted = sorted({r for p, r in roles.items() if p in sampler.peak and list(roles.values()).count(r) > 1})
    stats = C.step_stats(metrics, WARMUP)
    shutil_rmtree(work / name / "checkpoints")  # a few GB per run; the logs and events stay (--keep)
    return {"shards": shards, "step_log": bool(log_on), "slice_MB": [round(s / MB, 1) for s in facts["slice_bytes"]],
            "transfer_cap_MB": round(cap / MB, 1), "processes": procs,
            "cluster_total_MB": round(total / MB, 1),
            "restarted": restarted, "faults": faults,
            "cluster_x_param_bytes": round(total / facts["param_bytes"], 2),
            "over_budget": over_budget(procs),
            "step_time_median_s": C.rnd(stats.get("step_time_median_s"), 4),
            "steps": summ.get("steps"), "checkpoints_saved_at": saved,
            "params_sha256": summ.get("params_sha256"), "wall_s": round(wall, 1)}


def _order(role: str) -> tuple[int, str]:
    first = ("shard", "worker", "checkpointer", "coordinator", "zygote", "up", "redis")
    return next((i for i, f in enumerate(first) if role.startswith(f)), len(first)), role


def shutil_rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------- DDP baseline
def ddp_run(work: Path, wl: dict[str, Any], *, steps: int, ckpt_every: int, nproc: int = 2,
            attempts: int = 2) -> dict[str, Any]:
    """Two torchrun DDP ranks (gloo) of the same model, Adam, global batch and checkpoint cadence; each rank reports
    its own VmHWM at exit (exact, no sampling); the torchrun agent is sampled."""
    out = work / "ddp"
    out.mkdir(parents=True, exist_ok=True)
    argv = [C.PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), __file__,
            "--ddp-child", json.dumps(wl), "--steps", str(steps), "--ckpt-every", str(ckpt_every), "--out", str(out)]
    for attempt in range(1, attempts + 1):  # torchrun --standalone now and then fails to start its group here
        for f in out.glob("rank*.json"):
            f.unlink()
        log_path = work / f"ddp-{attempt}.log"
        g = C.ProcGroup(argv, log_path)
        try:
            with PeakSampler(g.pgid) as sampler:
                rc = g.wait(1200)
        finally:
            g.stop(grace=2)
        if rc == 0:
            break
        C.log(f"torchrun failed ({rc}), attempt {attempt}/{attempts}:\n{log_path.read_text(errors='replace')[-800:]}")
    else:
        raise RuntimeError(f"torchrun failed {attempts} times; see {log_path}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    rank_pids = {r["pid"] for r in ranks}
    agent = [peak for pid, peak in sampler.peak.items() if pid not in rank_pids]
    total = sum(r["vm_hwm"] for r in ranks)
    shutil_rmtree(out)
    return {"ranks_peak_MB": [round(r["vm_hwm"] / MB, 1) for r in ranks], "ranks_total_MB": round(total / MB, 1),
            "ranks_total_bytes": total, "agent_peak_MB": round(max(agent) / MB, 1) if agent else None,
            "step_time_median_s": C.rnd(C.median(ranks[0]["step_times_s"][WARMUP:]), 4),
            "optimizer": ranks[0]["optimizer"], "attempts": attempt}


def ddp_child(wl: dict[str, Any], steps: int, ckpt_every: int, out: Path) -> None:
    """One DDP rank (run by torchrun): the same model, data order and Adam as the CMEMI runs."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from cmemi.shared.config.lookup import resolve
    from cmemi.shared.core.data import fetch, microbatch_indices
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = resolve(wl["model"]["factory"], "model")(**wl["model"]["kwargs"])
    dataset = resolve(wl["data"]["factory"], "data")(**wl["data"]["kwargs"])
    net = DDP(model)
    cls = getattr(torch.optim, wl["optimizer"])
    try:  # what CMEMI's build_optimizer picks (shared/config/plugins.py): fused, else foreach
        opt, kind = cls(model.parameters(), lr=wl["lr"], fused=True), "fused"
    except (RuntimeError, TypeError, ValueError):
        opt, kind = cls(model.parameters(), lr=wl["lr"], foreach=True), "foreach"
    times = []
    for step in range(steps):
        t = time.perf_counter()
        x, y = fetch(dataset, microbatch_indices(0, len(dataset), wl["global_batch"], world, step, rank))
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if ckpt_every and (step + 1) % ckpt_every == 0 and rank == 0:
            tmp = out / f".tmp-{os.getpid()}.pt"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, out / "latest.pt")
        times.append(time.perf_counter() - t)
    dist.barrier()
    hwm = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
    (out / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "vm_hwm": hwm, "step_times_s": times,
                                                      "optimizer": f"{wl['optimizer']} ({kind})"}))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- one model, every K
def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def sweep(work: Path, wl: dict[str, Any], shards: list[int], steps: int, ckpt_every: int, workers: int,
          interpreter: int) -> dict[str, Any]:
    facts = model_facts(wl, 1)
    P = facts["param_bytes"]
    C.log(f"model {facts['params'] / 1e6:.1f} M parameters ({P / MB:.0f} MB); DDP, {workers} ranks, {steps} steps")
    ddp = ddp_run(work, wl, steps=steps, ckpt_every=ckpt_every, nproc=workers)
    C.log(f"DDP ranks {ddp['ranks_peak_MB']} MB; {ddp['step_time_median_s']} s/step")
    limit = cluster_budget(ddp["ranks_total_bytes"])
    by: dict[str, Any] = {}
    for k in shards:
        C.log(f"cmemi up: K = {k}, {workers} workers, {steps} steps, checkpoint every {ckpt_every}")
        r = cluster_run(work, wl, shards=k, workers=workers, steps=steps, ckpt_every=ckpt_every,
                        interpreter=interpreter)
        r["cluster_budget_MB"] = round(limit / MB, 1)
        r["cluster_vs_ddp_ranks"] = round(r["cluster_total_MB"] / ddp["ranks_total_MB"], 2)
        r["cluster_within_budget"] = r["cluster_total_MB"] * MB <= limit
        r["step_time_vs_ddp"] = C.ratio(r["step_time_median_s"], ddp["step_time_median_s"])
        by[str(k)] = r
        C.log(f"K = {k}: cluster {r['cluster_total_MB']:.0f} MB ({r['cluster_vs_ddp_ranks']}× DDP ranks), "
              f"{r['step_time_median_s']} s/step; over budget: {r['over_budget'] or 'none'}"
              + "".join(f"; {f['kind']} {f['role']} {f['id']} at {f['t_s']} s ({f['how']})" for f in r["faults"]
                        if f["kind"] == "died"))
    shas = {k: r["params_sha256"] for k, r in by.items()}
    return {"model": {**wl["model"], "params": facts["params"], "param_MB": round(P / MB, 1),
                      "optimizer": wl["optimizer"], "lr": wl["lr"]},
            "ddp": {k: v for k, v in ddp.items() if k != "ranks_total_bytes"}, "by_shards": by,
            "params_sha256": shas, "params_sha256_same": len(set(shas.values())) == 1}


def projected_peak(done: dict[str, Any], scale: float) -> int:
    """A bigger model's largest cluster total plus its DDP ranks, scaled from the measured one (memory grows with
    the parameters; the interpreters do not, so this overestimates a little)."""
    worst = max(r["cluster_total_MB"] for r in done["by_shards"].values())
    return int(scale * max(worst, done["ddp"]["ranks_total_MB"]) * MB)


def summarize(s: dict[str, Any]) -> dict[str, Any]:
    out = {"ddp_ranks_total_MB": s["ddp"]["ranks_total_MB"], "params_sha256_same": s["params_sha256_same"]}
    for k, r in s["by_shards"].items():
        peaks: dict[str, float] = {}
        for p in r["processes"]:
            key = "worker" if p["role"].startswith("worker") else p["role"]
            peaks[key] = max(peaks.get(key, 0.0), p["peak_MB"])
        out[f"K={k}"] = {"peak_MB_by_role": peaks, "cluster_total_MB": r["cluster_total_MB"],
                         "cluster_vs_ddp_ranks": r["cluster_vs_ddp_ranks"], "roles_over_budget": len(r["over_budget"]),
                         "cluster_within_budget": r["cluster_within_budget"], "step_time_vs_ddp": r["step_time_vs_ddp"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="K = 1, 2 and 12 steps, a checkpoint every 5 (development)")
    p.add_argument("--shards", default=None, help="K values (default 1,2,4; quick 1,2)")
    p.add_argument("--steps", type=int, default=None, help="default 25 (quick 12)")
    p.add_argument("--ckpt-every", type=int, default=None, help="default 10 (quick 5)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--params", type=float, default=113e6)
    p.add_argument("--scale", type=float, default=0, help="also a model this many times bigger, where memory allows")
    p.add_argument("--out", default=None, help="also write the JSON object to this file")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--ddp-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ddp_child is not None:
        return ddp_child(json.loads(args.ddp_child), args.steps, args.ckpt_every, Path(args.out))
    C.setup(threads=1)
    shards = [int(x) for x in (args.shards or ("1,2" if args.quick else "1,2,4")).split(",")]
    steps = args.steps or (12 if args.quick else 25)
    every = args.ckpt_every or (5 if args.quick else 10)
    work = C.workdir("memory")
    result: dict[str, Any] = {"bench": "memory", **C.provenance(), "machine": C.machine(), "quick": args.quick,
                              "command": "python bench/memory.py " + " ".join(sys.argv[1:])}
    result["machine"]["mem_total_MB"] = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / MB)
    t_start = time.monotonic()
    try:
        wl = workload(args.params)
        result["workload"] = {"workers": args.workers, "microbatches": args.workers, "spare_workers": 0,
                              "global_batch": wl["global_batch"], "steps": steps, "checkpoint_every": every,
                              "shards": shards, "data": wl["data"]}
        interp = interpreter_hwm()
        result["interpreter_MB"] = round(interp / MB, 1)
        C.log(f"interpreter (torch + services imported): {interp / MB:.0f} MB")
        main_sweep = sweep(work, wl, shards, steps, every, args.workers, interp)
        result.update(main_sweep)
        result["summary"] = summarize(main_sweep)
        if args.scale:
            need, avail = projected_peak(main_sweep, args.scale), mem_available()
            if need > 0.8 * avail:
                result["scaled"] = {"scale": args.scale, "skipped": (
                    f"projected peak {need / 1e9:.1f} GB (the largest measured total × {args.scale:g}) over 80 % of "
                    f"the {avail / 1e9:.1f} GB available")}
            else:
                big = sweep(work, workload(args.params * args.scale), shards, steps, every, args.workers, interp)
                result["scaled"] = {"scale": args.scale, **big, "summary": summarize(big)}
        result["notes"] = [
            "peak = VmHWM (/proc/PID/status), sampled every 0.1 s until the process exits; the cluster total sums every "
            "process's own peak (peaks at different times: an upper bound on the simultaneous use), `cmemi up`, Redis "
            "and the zygote included; DDP: each rank's VmHWM read by the rank itself at exit, the torchrun agent apart",
            "forked services share the zygote's pages until written: RSS counts them in every process that maps them",
            "budgets (issue 34): shard k 1.5 × (slice + optimizer state + one gradient sum) + interpreter; worker 1.3 × "
            "(parameters + gradients) + interpreter; checkpointer interpreter + 2 × transfer cap; cluster 1.5 × the two "
            "DDP ranks' peaks summed",
            "x_param_bytes = peak / parameter bytes; net_x_param_bytes = (peak − interpreter) / parameter bytes",
            f"{C.machine()['cpus']} shared CPU cores: step times are for the record (the goal is memory)",
        ]
    except BaseException as exc:
        C.record_error(result, exc)
        raise
    finally:
        C.finish(result, work, args.keep, t_start)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1, default=C.jsonable) + "\n")


if __name__ == "__main__":
    main()
