"""Peak RSS per process of a big model's cluster against issue 34's budgets (bench/memory.py), for
docs/benchmarks/index.md."""

from __future__ import annotations

from typing import Any

from scripts.tables import provenance
from scripts.tables.provenance import load, measured


def memory() -> str:
    """bench/memory.py: peak RSS per process of a big model's cluster against issue 34's budgets (optional file)."""
    if not (provenance.RESULTS / "memory.json").is_file():
        return ("No results yet: `.venv/bin/python bench/memory.py --out bench/results/memory.json` writes them "
                "(about 15 min on 2 cores).")
    d = load("memory")
    lines = [memory_lines(d)]
    scaled = d.get("scaled")
    if scaled and "skipped" in scaled:
        lines += ["", f"The {scaled['scale']:g}× larger model was not run: {scaled['skipped']}."]
    elif scaled:
        lines += ["", f"The {scaled['scale']:g}× larger model:", "", memory_lines({**d, **scaled})]
    return "\n".join([*lines, "", measured("memory")])


def memory_lines(d: dict[str, Any]) -> str:
    m, w, ddp = d["model"], d["workload"], d["ddp"]
    ok = {True: "✓", False: "✗"}

    def mb(x: float) -> str:
        return f"{x:,.0f} MB"

    kw = m["kwargs"]
    lines = [f"Measured with `{d['command']}`: an MLP {kw['in_dim']}-{kw['hidden']}×{kw['depth'] - 1}-10 "
             f"({m['params'] / 1e6:.1f} M parameters, {m['param_MB']:,.0f} MB of fp32), {m['optimizer']}, "
             f"{w['workers']} workers, batch {w['global_batch']} in {w['microbatches']} microbatches, {w['steps']} "
             f"steps with a checkpoint every {w['checkpoint_every']}. Peak RSS = VmHWM of each process, sampled "
             f"until it exits; interpreter (Python, torch and the services imported) {mb(d['interpreter_MB'])}. "
             f"Two DDP ranks (torchrun, gloo, {m['optimizer']}, the same batch and checkpoints) peaked at "
             f"{' + '.join(mb(x) for x in ddp['ranks_peak_MB'])} = {mb(ddp['ranks_total_MB'])}. Budgets (issue 34): "
             "a shard 1.5 × (its slice + its optimizer state + one gradient sum), a worker 1.3 × (parameters + "
             "gradients), each plus the interpreter; the checkpointer the interpreter + 2 × the transfer cap; the "
             "whole cluster (every process's peak summed, `cmemi up`, Redis and the zygote included) 1.5 × the DDP "
             "ranks.", "",
             "| K | process | peak RSS | × parameter bytes | budget | met |", "|---|---|---|---|---|---|"]
    for k, r in d["by_shards"].items():
        procs = r["processes"]
        budgeted = [p for p in procs if "budget_MB" in p]
        shards = sorted((p for p in budgeted if p["role"].startswith("shard")),
                        key=lambda p: (int(p["role"].split()[1]), -p["peak_MB"]))
        rows, seen = [], set()
        for p in shards:  # a restarted shard: its largest incarnation
            if p["role"] not in seen:
                seen.add(p["role"])
                rows.append((p["role"] + (" (leader)" if p["role"] == "shard 0" else ""), p))
        workers = [p for p in budgeted if p["role"].startswith("worker")]
        if workers:
            rows.append(("each worker (largest)", max(workers, key=lambda p: p["peak_MB"])))
        for role in sorted({p["role"] for p in budgeted if not p["role"].startswith(("shard", "worker"))}):
            rows.append((role, max((p for p in budgeted if p["role"] == role), key=lambda p: p["peak_MB"])))
        for name, p in rows:
            lines.append(f"| {k} | {name} | {mb(p['peak_MB'])} | {p['x_param_bytes']:.1f} | {mb(p['budget_MB'])} | "
                         f"{ok[p['within_budget']]} |")
        lines.append(f"| {k} | **whole cluster** | **{mb(r['cluster_total_MB'])}** | {r['cluster_x_param_bytes']:.1f} | "
                     f"{mb(r['cluster_budget_MB'])} (1.5 × DDP's {mb(ddp['ranks_total_MB'])}) | "
                     f"{ok[r['cluster_within_budget']]} |")
    times = "; ".join(f"K = {k} {r['step_time_median_s']:.2f} s ({r['step_time_vs_ddp']:.2f}× DDP)"
                      for k, r in d["by_shards"].items())
    sha = ("the same at every K" if d["params_sha256_same"] else
           "**differ between K** (" + ", ".join(f"K = {k} `{r['params_sha256'][:12]}`" for k, r in d["by_shards"].items())
           + ")")
    lines += ["", f"Step time (median, 2 shared cores: for the record, the goal is memory): {times}; DDP "
              f"{ddp['step_time_median_s']:.2f} s. `params_sha256`: {sha}."]
    died = {k: [f for f in r.get("faults", []) if f["kind"] == "died"] for k, r in d["by_shards"].items()}
    if any(died.values()):
        lines[-1] += (" Processes that died and were replaced mid-run (their replacements' peaks, restore included, "
                      "are in the table): " + "; ".join(
                          f"K = {k}: " + ", ".join(f"{f['role'] if f['role'] != 'aggregator' else 'shard'} {f['id']} "
                                                   f"after step {f['after_step']} ({f['how']})" for f in fs)
                          for k, fs in died.items() if fs) + ".")
    return "\n".join(lines)
